"""Dropout in training equals CPU torch under one seed: forward values, gradients and the generator state afterwards,
eager and compiled, in thread and process mode (compiled on processes: not the generator state), over Shard/Replicate parameters and inputs on 2- and 4-device meshes.

Regressions these catch: with an input that requires grad, torch's decomposition of ``dropout`` takes the fused
``native_dropout`` path for PrivateUse1 tensors, which had no rule (eager training with ``nn.Dropout`` failed);
``device/dropout.py`` now runs CPU torch's unfused path. ``torch.compile`` captures ``native_dropout`` whatever
the device (torch's Python decomposition of ``dropout``), which now has a rule drawing CPU torch's mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_dtorch as dt
from tests.eager.conftest import TEST_MODE
from tests.training.conftest import init_mesh
from torch_dtorch import Replicate, Shard

ATOL = 1e-6

#: compiled programs draw ``native_dropout``'s mask on the workers (the rule's kernel): from the controller's
#: generator in thread mode; in process mode from the worker processes' generators, which the controller's
#: ``torch.manual_seed`` sets (``device/worker_rng.py``) but whose draws do not advance the controller's
WORKER_DRAWS_LEAVE_CONTROLLER_STATE = TEST_MODE == "process"


class DropMLP(nn.Module):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.drop = nn.Dropout(p)
        self.b = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


def _distributed(ref: nn.Module, mesh: dt.DeviceMesh, sharded: str) -> nn.Module:
    """A copy of ``ref`` whose ``a.weight`` is ``Shard(0)`` (``sharded="a"``) or replicated, the rest replicated."""
    model = copy.deepcopy(ref)
    for mod_name, mod in (("a", model.a), ("b", model.b)):
        for attr in ("weight", "bias"):
            value = getattr(mod, attr).detach()
            pl = [Shard(0)] if (mod_name == sharded and attr == "weight") else [Replicate()]
            pl = pl + [Replicate()] * (mesh.ndim - 1)
            setattr(mod, attr, nn.Parameter(dt.distribute_tensor(value, mesh, pl)))
    return model


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if t.device.type == "dtorch" else t


def _steps(model: nn.Module, x: torch.Tensor, n: int = 3, *, seed: int = 100) -> list[torch.Tensor]:
    outs = []
    for i in range(n):
        torch.manual_seed(seed + i)
        out = model(x)
        out.sum().backward()
        outs.append(_full(out.detach()))  # a sync for dtorch: the workers drew before the next seed
    return outs


@pytest.mark.parametrize(
    ("mesh_shape", "sharded", "x_placement"),
    [((2,), "a", Shard(0)), ((2,), "none", Replicate()), ((4,), "a", Shard(1)), ((2, 2), "a", Shard(0))],
    ids=["2-shard-batch", "2-replicate", "4-shard-features", "2x2"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_with_dropout_equals_cpu_torch(
    mesh_shape: tuple[int, ...], sharded: str, x_placement: object, compiled: bool
) -> None:
    torch.manual_seed(0)
    ref = DropMLP(0.1)
    mesh = init_mesh(mesh_shape)
    model = _distributed(ref, mesh, sharded)
    x = torch.randn(8, 6)
    want = _steps(ref, x)
    want_state = torch.get_rng_state()
    run = torch.compile(model, backend="dtorch") if compiled else model
    xd = dt.distribute_tensor(x, mesh, [x_placement] + [Replicate()] * (mesh.ndim - 1))  # type: ignore[list-item]
    got = []
    for i in range(3):
        torch.manual_seed(100 + i)
        out = run(xd)
        out.sum().backward()
        got.append(out.detach().full_tensor())  # a sync: the workers drew before the next seed
    if not (compiled and WORKER_DRAWS_LEAVE_CONTROLLER_STATE):
        assert torch.equal(torch.get_rng_state(), want_state)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(
            _full(p.grad), q.grad, atol=ATOL, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
        if compiled:  # the backward program leaves each gradient in its parameter's placements
            assert p.grad.placements == p.placements, name


def test_dropout_with_grad_is_cpu_torch_bit_for_bit() -> None:
    """Elementwise, nothing is summed: the output and the input's gradient equal CPU torch exactly, and the
    generator ends where CPU torch's does."""
    mesh = init_mesh((2,))
    x = torch.randn(6, 10)
    torch.manual_seed(3)
    xr = x.clone().requires_grad_()
    want = F.dropout(xr, 0.3, True)
    want.backward(torch.ones_like(want))
    state = torch.get_rng_state()
    torch.manual_seed(3)
    xd = dt.distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    got = F.dropout(xd, 0.3, True)
    got.backward(dt.distribute_tensor(torch.ones_like(want), mesh, [Shard(1)]))
    assert got.placements == (Shard(1),)
    assert torch.equal(got.detach().full_tensor(), want.detach())
    assert torch.equal(xd.grad.full_tensor(), xr.grad)
    assert torch.equal(torch.get_rng_state(), state)


def test_compiled_dropout_where_float32_scales_differ() -> None:
    """At ``p = 0.15`` ``float32(1 / (1 - p))`` differs from ``1 / float32(1 - p)`` by one ulp: the compiled path
    (``native_dropout``, as plain ``torch.compile(backend="aot_eager")`` runs it) scales by the first, eager CPU
    torch (``noise.div_(1 - p)``) by the second. Compiled dtorch equals plain aot_eager exactly in the mask and to
    float rounding in the values, and eager CPU torch to 1 ulp."""
    torch.manual_seed(0)
    ref = DropMLP(0.15)
    mesh = init_mesh((2,))
    model = _distributed(ref, mesh, "a")
    x = torch.randn(8, 6)
    want = _steps(torch.compile(copy.deepcopy(ref), backend="aot_eager"), x, 2)
    eager = _steps(copy.deepcopy(ref), x, 2)
    xd = dt.distribute_tensor(x, mesh, [Shard(0)])
    got = _steps(torch.compile(model, backend="dtorch"), xd, 2)
    for g, w, e in zip(got, want, eager, strict=True):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-6)
