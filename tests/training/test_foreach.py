"""``_foreach_*`` list rules on dtorch tensors: optimizer steps with ``foreach=True`` (torch's default for dtorch
parameters) equal single-device torch over sharded, replicated and uneven parameters whose gradients arrive in any
placement (``Partial`` included); one list operator per call, planned once; the op-by-op fallback."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.placement import Placements

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.05),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}

#: (shape, parameter placements, gradient placements) on a 1-D and a 2-D mesh: uneven shards, Partial gradients
LAYOUT_1D: list[tuple[tuple[int, ...], Placements, Placements]] = [
    ((7, 5), (Shard(0),), (Shard(0),)),
    ((5,), (Replicate(),), (Partial(),)),
    ((3, 9), (Shard(1),), (Replicate(),)),
    ((6, 4), (Replicate(),), (Replicate(),)),
    ((1, 4), (Shard(0),), (Shard(0),)),  # an empty shard on rank 1
]
LAYOUT_2D: list[tuple[tuple[int, ...], Placements, Placements]] = [
    ((7, 5), (Shard(0), Shard(1)), (Shard(0), Shard(1))),
    ((5,), (Replicate(), Replicate()), (Partial(), Replicate())),
    ((3, 9), (Replicate(), Shard(1)), (Partial(), Shard(1))),
    ((6, 4), (Shard(0), Replicate()), (Shard(0), Partial())),
]


class _Ops(TorchDispatchMode):
    """Counts the list ops dispatched on dtorch tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        first = args[0] if args else None
        if isinstance(first, (list, tuple)) and first and first[0].device.type == "dtorch":
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1  # (the optimizer's step counters are CPU)
        return func(*args, **(kwargs or {}))


def _params(mesh: dt.DeviceMesh, layout: list[Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ours, ref = [], []
    for shape, pl, _ in layout:
        value = torch.randn(shape)
        ref.append(torch.nn.Parameter(value.clone()))
        ours.append(torch.nn.Parameter(dt.distribute_tensor(value, mesh, list(pl))))
    return ours, ref


def _set_grads(
    ours: list[torch.Tensor], ref: list[torch.Tensor], layout: list[Any], mesh: dt.DeviceMesh
) -> None:
    for p, r, (shape, _, gpl) in zip(ours, ref, layout, strict=True):
        g = torch.randn(shape)
        r.grad = g
        if any(isinstance(x, Partial) for x in gpl):  # a Partial gradient: shares that sum to g
            full = dt.distribute_tensor(g, mesh, [Replicate()] * mesh.ndim)
            p.grad = full.redistribute(mesh, list(gpl))
        else:
            p.grad = dt.distribute_tensor(g, mesh, list(gpl))
        assert p.grad.placements == tuple(gpl)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["mesh2", "mesh2x2"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_foreach_steps_equal_torch(name: str, mesh_shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    mesh = init_mesh(mesh_shape)
    layout = LAYOUT_1D if len(mesh_shape) == 1 else LAYOUT_2D
    ours, ref = _params(mesh, layout)
    opt, ref_opt = OPTIMIZERS[name](ours), OPTIMIZERS[name](ref)
    assert opt.defaults["foreach"] is None  # torch's default: foreach for dtorch parameters
    for _ in range(3):
        _set_grads(ours, ref, layout, mesh)
        opt.step()
        ref_opt.step()
    for p, r, (_, pl, gpl) in zip(ours, ref, layout, strict=True):
        assert p.placements == tuple(pl)  # updated in place, where they are
        torch.testing.assert_close(p.full_tensor(), r.detach(), atol=1e-5, rtol=1e-5)
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                # the state is made like the parameter (Adam) or cloned from the gradient (SGD's momentum)
                assert v.placements in (tuple(pl), tuple(gpl))


def test_step_is_list_ops_and_plans_once() -> None:
    """torch picks the foreach path for dtorch parameters; each list op is one operator for the whole list,
    and the second step plans nothing new (the scalars change every step, the plans do not depend on them)."""
    from torch_dtorch.device.state import get_session
    from torch_dtorch.placement_rules.families.foreach import ForeachRule

    torch.manual_seed(0)
    mesh = init_mesh((2,))
    ours, ref = _params(mesh, LAYOUT_1D)
    _set_grads(ours, ref, LAYOUT_1D, mesh)
    opt = torch.optim.AdamW(ours, lr=0.01)
    opt.step()
    ours[0].full_tensor()
    calls: list[str] = []
    planned: list[Any] = []
    original = ForeachRule.signatures

    def spy(self: ForeachRule, call: Any) -> Any:
        planned.append(call.op)
        return original(self, call)

    graph = get_session().executor
    listener = lambda node: calls.append(str(node.op))  # noqa: E731
    graph.constructor.listeners.append(listener)
    ForeachRule.signatures = spy  # type: ignore[method-assign]
    try:
        with _Ops() as seen:
            opt.step()
    finally:
        ForeachRule.signatures = original  # type: ignore[method-assign]
        graph.constructor.listeners.remove(listener)
    assert planned == []
    foreach_ops = [k for k in seen.ops if k.startswith("aten._foreach_")]
    assert foreach_ops and all(seen.ops[k] <= 2 for k in foreach_ops)
    # the Partial gradient of the replicated bias is all-reduced once, inside the step's first list op using it
    assert sum(1 for c in calls if "_foreach_" in c) == sum(seen.ops[k] for k in foreach_ops)


def test_out_of_place_and_partial_linear() -> None:
    """Out-of-place list ops keep each element's shard; linear ops keep a Partial element Partial, others reduce."""
    mesh = init_mesh((2,))
    a = [torch.randn(5, 3), torch.randn(4)]
    b = [torch.randn(5, 3), torch.randn(4)]
    da = [dt.distribute_tensor(a[0], mesh, [Shard(0)]), dt.distribute_tensor(a[1], mesh, [Replicate()])]
    db = [dt.distribute_tensor(b[0], mesh, [Replicate()]), dt.distribute_tensor(b[1], mesh, [Replicate()])]
    db[1] = db[1].redistribute(mesh, [Partial()])
    out = torch._foreach_mul(da, db)
    assert [t.placements for t in out] == [(Shard(0),), (Replicate(),)]
    for got, want in zip(out, torch._foreach_mul(a, b), strict=True):
        torch.testing.assert_close(got.full_tensor(), want)
    scaled = torch._foreach_mul([db[1]], 3.0)
    assert scaled[0].placements == (Partial(),)
    torch.testing.assert_close(scaled[0].full_tensor(), b[1] * 3.0)
    roots = torch._foreach_sqrt([x.abs() for x in da])
    for got, want in zip(roots, torch._foreach_sqrt([x.abs() for x in a]), strict=True):
        torch.testing.assert_close(got.full_tensor(), want)


def test_inplace_on_partial_runs_op_by_op() -> None:
    """``_foreach_add_(partial, 1.0)`` is not linear: no list signature keeps self Partial, so the device runs
    torch's per-tensor kernel (each ``add_`` reduces and writes back), still equal to torch."""
    mesh = init_mesh((2,))
    g = torch.randn(6)
    p = dt.distribute_tensor(g, mesh, [Replicate()]).redistribute(mesh, [Partial()])
    q = dt.distribute_tensor(g, mesh, [Shard(0)])
    torch._foreach_add_([p, q], 1.0)
    torch.testing.assert_close(p.full_tensor(), g + 1.0)
    torch.testing.assert_close(q.full_tensor(), g + 1.0)
    assert q.placements == (Shard(0),)


def test_adamw_step_time_printed(capsys: pytest.CaptureFixture[str]) -> None:
    """The AdamW step over 200 parameters (half sharded, half replicated) on 2 CPU workers, foreach vs the
    single-tensor path: printed (run with -s) for docs/training.md; the list path must not be slower."""
    mesh = init_mesh((2,))
    torch.manual_seed(0)
    times = {}
    for foreach in (True, False):
        params = []
        for i in range(200):
            pl = [Shard(0)] if i % 2 == 0 else [Replicate()]
            p = torch.nn.Parameter(dt.distribute_tensor(torch.randn(17 + i % 5, 8), mesh, pl))
            p.grad = dt.distribute_tensor(torch.randn(17 + i % 5, 8), mesh, pl)
            params.append(p)
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
        best = float("inf")
        for _ in range(4):
            t0 = time.perf_counter()
            opt.step()
            params[-1].full_tensor()  # the last parameter's update is the step's last op
            best = min(best, time.perf_counter() - t0)
        times[foreach] = best
    with capsys.disabled():
        print(f"\nAdamW step, 200 params, 2 CPU workers: foreach {times[True] * 1e3:.1f} ms, "
              f"single-tensor {times[False] * 1e3:.1f} ms")  # fmt: skip
    assert times[True] < times[False] * 1.5
