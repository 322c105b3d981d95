"""The ops of a training step on the eager fast path (issue 24): after the first call of a step's op on given
layouts, later calls plan nothing (``GraphConstructor.num_planned``) and give the values plain torch gives.

- ``cat`` of a list holding an *unbound* tensor (a KV cache's ``torch.tensor([], device=x.device)``, which HF models
  build every forward, training included);
- the SDPA pair with its log-sum-exp (``attention_grad.py``: forward and backward), whose ``attn_mask`` is a
  keyword-only ``Tensor?`` slot;
- the in-place ``_foreach_*_`` list ops of ``torch.optim`` (``foreach=True``), whose per-step scalars are no part
  of the key.

Meshes 1, 2, 3 (uneven), 2x2; thread mode and ``DTORCH_TEST_MODE=process``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import init_mesh, mesh_ids
from torch_dtorch import Replicate, Shard
from torch_dtorch.device.state import get_session

MESHES = [(1,), (2,), (3,), (2, 2)]


def _planned() -> int:
    return get_session().executor.constructor.num_planned  # type: ignore[no-any-return]


def _placements(mesh: dt.DeviceMesh, kind: str) -> list[Any]:
    one = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}[kind]
    return [one] + [Replicate()] * (mesh.ndim - 1)


def _steady(fn: Callable[[], Any], *, warm: int = 2, steps: int = 2) -> list[Any]:
    """``fn()`` ``warm`` times, then ``steps`` times asserting that nothing is planned in full; the last results."""
    for _ in range(warm):
        fn()
    dt.sync()
    planned = _planned()
    out: list[Any] = []
    for _ in range(steps):
        out = fn()
    dt.sync()
    assert _planned() == planned, f"planned in full in a steady step: {_planned() - planned}"
    return out


@pytest.mark.parametrize("shape", MESHES, ids=mesh_ids)
@pytest.mark.parametrize("kind", ["R", "S0", "S1"])
def test_cat_with_an_unbound_element_hits(shape: tuple[int, ...], kind: str) -> None:
    mesh = init_mesh(shape)
    a = torch.randn(5, 3, 4)  # uneven over 2 and 3 devices
    x = dt.distribute_tensor(a, mesh, _placements(mesh, kind))

    def step() -> list[Any]:
        cache = torch.tensor([], device=x.device)  # unbound, new every step
        k = torch.cat([cache, x], dim=-2)
        return [torch.cat([k, x * 2], dim=-2)]

    (got,) = _steady(step)
    want = torch.cat([a, a * 2], dim=-2)
    assert torch.equal(dt.to_torch(got), want)


def _attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, ...]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    (out * out).sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("shape", MESHES, ids=mesh_ids)
@pytest.mark.parametrize("kind", ["R", "S0", "S1"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("batch", [3, 1])
def test_attention_forward_and_backward_hit(
    shape: tuple[int, ...], kind: str, causal: bool, batch: int
) -> None:
    """Uneven shards of the batch (3) and heads (5); empty shards (batch 1 over several devices: the blockwise
    kernel runs there, the fused CPU op elsewhere). Sequence-sharded attention: test_cp_attention_backward.py."""
    mesh = init_mesh(shape)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(batch, 5, 6, 4, generator=g) for _ in range(3)]
    xs = [dt.distribute_tensor(t, mesh, _placements(mesh, kind)) for t in qkv]
    got = _steady(lambda: _attention_step(*xs, causal))
    want = _attention_step(*qkv, causal)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(dt.to_torch(a), b, atol=1e-5, rtol=1e-5, msg=name)


def _params(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(*s, generator=g) for s in shapes]


OPTIMIZERS: list[tuple[str, Callable[[list[Any]], torch.optim.Optimizer]]] = [
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
    ("adam_amsgrad", lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True)),
    ("sgd_momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=True)),
]


@pytest.mark.parametrize("shape", MESHES, ids=mesh_ids)
@pytest.mark.parametrize("kind", ["R", "S0", "S1"])
@pytest.mark.parametrize(("name", "make"), OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_foreach_optimizer_step_hits(
    shape: tuple[int, ...], kind: str, name: str, make: Callable[[list[Any]], torch.optim.Optimizer]
) -> None:
    """Every step's list ops hit after the first steps, with the step's own scalars (bias corrections and a
    scheduler's learning rate change every step); parameters and states equal torch's after every step."""
    mesh = init_mesh(shape)
    values = _params([(5, 3), (3, 5), (7, 2)])  # uneven over 2 and 3 devices
    grads = _params([(5, 3), (3, 5), (7, 2)])
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    ps = [torch.nn.Parameter(dt.distribute_tensor(v, mesh, _placements(mesh, kind))) for v in values]
    opts = [make(ref), make(ps)]
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in opts]

    def step(params: list[Any], opt: torch.optim.Optimizer, sched: Any, dist: bool) -> None:
        for p, gr in zip(params, grads, strict=True):
            p.grad = dt.distribute_tensor(gr, mesh, _placements(mesh, kind)) if dist else gr.clone()
        opt.step()
        sched.step()

    for i in range(5):
        step(ref, opts[0], scheds[0], False)
        if i == 3:
            dt.sync()
            planned = _planned()
        step(ps, opts[1], scheds[1], True)
        dt.sync()
        if i >= 3:
            assert _planned() == planned, f"{name}: the optimizer step planned in full"
        for p, r in zip(ps, ref, strict=True):
            torch.testing.assert_close(dt.to_torch(p.detach()), r.detach(), atol=1e-6, rtol=1e-6)
    for p, r in zip(ps, ref, strict=True):
        for k, v in opts[0].state[r].items():
            got = opts[1].state[p][k]
            torch.testing.assert_close(dt.to_torch(got) if got.device.type != "cpu" else got, v, msg=k)


def test_foreach_write_through_a_copy_view_raises_as_on_the_full_path() -> None:
    """An in-place list op on a view of a redistributed copy misses (the hit would write into the copy, which
    nothing reads), and the full path raises, after a template of the same layouts was learned."""
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(5, 6), mesh, [Shard(0)])
    y = x[1:3]  # across the shards: a view of a gathered copy
    z = dt.distribute_tensor(torch.randn(2, 6), mesh, list(y.placements))
    for _ in range(2):
        torch._foreach_mul_([z], 2.0)
    with pytest.raises(NotImplementedError, match="redistributed copy"):
        torch._foreach_mul_([y], 2.0)


@pytest.mark.parametrize("shape", MESHES, ids=mesh_ids)
@pytest.mark.parametrize("kind", ["R", "S0", "S1"])
def test_dtype_casts_under_grad_hit(shape: tuple[int, ...], kind: str) -> None:
    """``x.to(dtype)`` of a tensor that requires grad decomposes to ``_to_copy`` (RMSNorm's float32 round trip in
    a bf16 model): it hits, forward and backward, and the gradient equals torch's."""
    mesh = init_mesh(shape)
    a = torch.randn(5, 7).to(torch.bfloat16)

    def step(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = t.detach().requires_grad_()
        h = x.to(torch.float32)
        y = (h * (h * h).mean(-1, keepdim=True).add(1e-6).rsqrt()).to(torch.bfloat16)  # RMSNorm's
        y.float().sum().backward()
        assert x.grad is not None
        return y.detach(), x.grad

    x = dt.distribute_tensor(a, mesh, _placements(mesh, kind))
    got = _steady(lambda: step(x))
    want = step(a)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(dt.to_torch(g), w)  # (bf16 tolerances: S1 sums the mean's partials)
