"""``torch.compile(opt.step, backend="dtorch")`` from the optimizer's very first step (the step that makes the
state): SGD with momentum, Adam and AdamW, ``foreach`` on and off, over Shard and Replicate parameters on a 2-device
(TP) and a 2 x 2 (dp x tp) mesh, equal plain single-device torch and eager dtorch (float32, 1e-6) over 4 steps.

Regressions these catch: the compiled first step failed in aot's mutation epilogue (the CPU ``step`` counter Adam
makes for non-CUDA parameters, updated by the program and copied back: ``cpu_t.copy_(dtorch_t)`` was not a
download), and ``foreach=False`` Adam failed at propagation (dynamo rewrites ``addcmul_``/``addcdiv_`` with a
``value`` into ``prims.fma``, which had no decomposition)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from tests.training.models import MLP, twin
from torch_dtorch import Replicate, Shard

TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
ATOL = 1e-6

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=0.01, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=fe),
}


def _batches(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    for _ in range(n):
        yield torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)


def _max_diff(model: torch.nn.Module, ref: torch.nn.Module) -> float:
    return max(
        (p.detach().full_tensor() - q.detach()).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )


def _run(
    name: str, foreach: bool, mesh_shape: tuple[int, ...], *, compiled: bool, steps: int = 4
) -> tuple[float, torch.nn.Module, torch.optim.Optimizer]:
    """Train a TP MLP on dtorch (opt.step compiled from the first step or eager) next to torch; returns the largest
    parameter difference to torch over the steps, the model and the optimizer."""
    torch.manual_seed(0)
    ref = MLP()
    if len(mesh_shape) == 1:
        mesh = init_mesh(mesh_shape, mesh_dim_names=("tp",))
        model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
        batch = [Replicate()]
    else:
        mesh = init_mesh(mesh_shape, mesh_dim_names=("dp", "tp"))
        model = dt.parallelize_module(twin(ref), mesh, TP_PLAN, tp_dim="tp")
        batch = [Shard(0), Replicate()]
    dt.match_grad_placements(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters(), foreach), OPTIMIZERS[name](ref.parameters(), foreach)
    step = torch.compile(opt.step, backend="dtorch") if compiled else opt.step
    worst = 0.0
    for x, y in _batches(steps):
        opt.zero_grad(set_to_none=True)
        xd, yd = dt.distribute_tensor(x, mesh, batch), dt.distribute_tensor(y, mesh, batch)
        F.mse_loss(model(xd), yd).backward()
        step()
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        worst = max(worst, _max_diff(model, ref))
    return worst, model, opt


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_compiled_from_first_step_equals_torch(name: str, foreach: bool) -> None:
    worst, model, opt = _run(name, foreach, (2,), compiled=True)
    assert worst <= ATOL, f"{name} foreach={foreach}: {worst}"
    for p in model.parameters():  # the state lives with the parameter's shards
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                assert value.placements == p.placements, key
    if name != "sgd_momentum":  # the step counters are made on the dtorch device, as dynamo does for CUDA
        w = model.in_proj.weight
        assert opt.state[w]["step"].device.type == "dtorch"
        assert opt.param_groups[0]["capturable"] is True
        assert float(opt.state[w]["step"].full_tensor()) == 4.0


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_compiled_first_step_dp_tp_mesh(name: str) -> None:
    """4 devices (dp x tp): Shard(0)/Shard(1)/Replicate parameters, the batch sharded on dp."""
    worst, _, _ = _run(name, True, (2, 2), compiled=True)
    assert worst <= ATOL, worst


def test_compiled_equals_eager_dtorch() -> None:
    """The compiled-from-the-first-step trajectory equals eager dtorch's (same model, same batches)."""
    _, compiled, _ = _run("adamw", True, (2,), compiled=True, steps=3)
    _, eager, _ = _run("adamw", True, (2,), compiled=False, steps=3)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(
            p.detach().full_tensor(), q.detach().full_tensor(), atol=ATOL, rtol=0, msg=name
        )


def test_compiled_train_step_with_optimizer_inside() -> None:
    """A compiled function doing forward, backward and ``opt.step()`` (dynamo breaks the graph at ``backward``)
    from the first call, Adam over Shard and Replicate parameters, equals torch."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
    dt.match_grad_placements(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)

    @torch.compile(backend="dtorch")
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for x, y in _batches(3):
        loss = train_step(dt.distribute_tensor(x, mesh), dt.distribute_tensor(y, mesh))
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss.full_tensor(), want.detach(), atol=ATOL, rtol=0)
    assert _max_diff(model, ref) <= ATOL


def test_plain_tensor_copy_from_dtorch_downloads() -> None:
    """``cpu_t.copy_(dtorch_t)`` downloads, as ``cpu_t.copy_(cuda_t)`` does (aot's epilogue writes mutated plain
    inputs back this way)."""
    mesh = init_mesh((2,))
    value = torch.arange(6.0).reshape(3, 2)
    dst = torch.zeros(3, 2)
    assert dst.copy_(dt.distribute_tensor(value, mesh, [Shard(0)])) is dst
    assert torch.equal(dst, value)
    scalar = torch.tensor(0.0)
    scalar.copy_(dt.distribute_tensor(torch.tensor(3.0), mesh))
    assert scalar.item() == 3.0


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
def test_compiled_step_with_lr_schedule_equals_torch(foreach: bool) -> None:
    """A StepLR schedule changes ``lr`` every step: dynamo recompiles with ``lr`` as a dynamic float (a 0-d float64
    input that torch's scalar pass casts with ``prims.convert_element_type``); AdamW from the first step still equals
    torch."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=foreach)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, foreach=foreach)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 1, 0.5)
    step = torch.compile(opt.step, backend="dtorch")
    for x, y in _batches(4):
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(dt.distribute_tensor(x, mesh)), dt.distribute_tensor(y, mesh)).backward()
        step()
        sched.step()
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
    assert _max_diff(model, ref) <= ATOL
