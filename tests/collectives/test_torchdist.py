"""``TorchDistGroup`` / ``TorchDistComm`` over Gloo: two thread-ranks in one process, one in-process HashStore, no
``init_process_group``; every collective equals the in-memory group's result. NCCL uses the same code path with
``backend="nccl"`` and CUDA tensors; it is not exercised here (no GPU on CI)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from tests.collectives.util import run_ranks
from torch_dtorch.collectives import InMemoryWorld, TorchDistComm, TorchDistGroup, execute_plan
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import parse_placements
from torch_dtorch.placement_rules.ranks import distribute
from torch_dtorch.placement_rules.redistribute.planner import plan_redistribute
from torch_dtorch.placement_rules.redistribute.simulate import apply_plan

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs Gloo")

DEVICES = (0, 1)
_PREFIX = itertools.count()


def _ops(g, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> list[torch.Tensor]:
    """The same sequence of collectives on any Group; ``x``: uneven along dim 1, ``y``: equal shapes,
    ``z``: for all-to-all (uneven along dim 0)."""
    out = [
        g.all_gather(x, 1),
        g.all_gather(x, 1, sizes=[3, 0]),
        g.all_gather(x.transpose(0, 1), 0),  # non-contiguous input
    ]
    out += [g.all_reduce(y, op) for op in ("sum", "avg", "max", "min")]
    out += [g.all_reduce(y.long(), "avg")]
    out += [g.reduce_scatter(y, op, 1) for op in ("sum", "avg", "max")]  # dim 1 of size 3: chunks 2, 1
    out += [g.reduce_scatter(y, "sum", 0)]  # dim 0 of size 1: chunks 1, 0
    out += [g.all_to_all(z, 0, 1), g.all_to_all(z, 0, 1, src_sizes=[3, 1])]
    out += [g.all_to_all(torch.empty(0, 5, device=y.device), 1, 0)]
    out += [g.broadcast(y if g.rank == 1 else None, 1)]
    g.barrier()
    return out


def _data(d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # integer-valued floats: every backend's reduction order gives the same bits
    x = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)[:, : 3 - 3 * d] + 100 * d
    y = torch.tensor([[1.0, -2.0, 5.0]]) * (d + 2)
    z = torch.arange(3 - 2 * d).reshape(-1, 1).expand(-1, 3) * 10.0 + d + torch.arange(3.0)
    return x, y, z


def test_gloo_group_equals_in_memory_group() -> None:
    store = dist.HashStore()
    prefix = f"t{next(_PREFIX)}"
    world = InMemoryWorld(DEVICES, timeout_s=20)

    def body(d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g = TorchDistGroup.create(dist.PrefixStore(prefix, store), DEVICES, d, timeout_s=20)
        assert (g.rank, g.size, g.devices) == (d, 2, DEVICES)
        return _ops(g, *_data(d)), _ops(world.group(DEVICES).handle(d), *_data(d))

    out = run_ranks(DEVICES, body).check()
    for d in DEVICES:
        gloo, mem = out[d]
        assert len(gloo) == len(mem)
        for i, (a, b) in enumerate(zip(gloo, mem)):
            assert a.dtype == b.dtype and a.shape == b.shape, (d, i, a.shape, b.shape)
            assert torch.equal(a, b), (d, i, a, b)


def test_gloo_group_moves_complex_tensors() -> None:
    """Gloo has no complex types: complex (and conjugate-view) tensors travel as (real, imag) pairs, with negative
    dims meaning the complex tensor's dims."""
    store = dist.HashStore()
    prefix = f"t{next(_PREFIX)}"
    world = InMemoryWorld(DEVICES, timeout_s=20)

    def ops(g, d: int) -> list[torch.Tensor]:
        x = torch.complex(torch.arange(6.0).reshape(2, 3), torch.full((2, 3), float(d + 1)))
        return [
            g.all_gather(x, -1),
            g.all_gather(x.conj(), 0),
            g.all_reduce(x, "sum"),
            g.reduce_scatter(x, "sum", -1),
            g.all_to_all(x, 0, 1),
            g.broadcast(x.conj() if g.rank == 0 else None, 0),
        ]

    def body(d: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g = TorchDistGroup.create(dist.PrefixStore(prefix, store), DEVICES, d, timeout_s=20)
        return ops(g, d), ops(world.group(DEVICES).handle(d), d)

    out = run_ranks(DEVICES, body).check()
    for d in DEVICES:
        for i, (a, b) in enumerate(zip(*out[d], strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape, (d, i, a.shape, b.shape)
            assert torch.equal(a.resolve_conj(), b.resolve_conj()), (d, i, a, b)


def test_gloo_comm_point_to_point_and_execute_plan() -> None:
    store = dist.HashStore()
    prefix = f"t{next(_PREFIX)}"
    mesh = DeviceMesh.from_shape("cpu", (2,))
    stage0, stage1 = DeviceMesh("cpu", [0]), DeviceMesh("cpu", [1])
    shape = (5, 3)
    x = torch.arange(15.0).reshape(shape)
    plans = [
        plan_redistribute(shape, mesh, parse_placements("S(0)"), dst_placements=parse_placements("S(1)")),
        plan_redistribute(shape, mesh, parse_placements("S(1)"), dst_placements=parse_placements("P(sum)")),
        plan_redistribute(shape, mesh, parse_placements("P(sum)"), dst_placements=parse_placements("S(0)")),
        plan_redistribute(shape, mesh, parse_placements("S(0)"), dst_placements=parse_placements("R")),
    ]
    stage_plan = plan_redistribute(shape, stage0, parse_placements("R"), stage1, parse_placements("R"))
    first = distribute(x, (2,), plans[0].src_placements)
    want = dict(first)
    for plan in plans:
        want = apply_plan(plan, want)

    def body(d: int) -> tuple[torch.Tensor | None, ...]:
        comm = TorchDistComm(store, d, DEVICES, prefix=prefix, timeout_s=20)
        if d == 0:
            comm.send(torch.arange(4).reshape(2, 2), 1, tag=3).wait()
            comm.send(torch.empty(0, 2), 1, tag=4).wait()
            got = None
        else:
            got = (comm.recv(0, tag=3), comm.recv(0, tag=4))
        t = first[(d,)]
        for plan in plans:
            t = execute_plan(plan, t, device=d, comm=comm)
        moved = execute_plan(stage_plan, x.clone() if d == 0 else None, device=d, comm=comm)
        return got, t, moved

    out = run_ranks(DEVICES, body).check()
    got = out[1][0]
    assert torch.equal(got[0], torch.arange(4).reshape(2, 2)) and got[1].shape == (0, 2)
    for d in DEVICES:
        assert torch.equal(out[d][1], want[(d,)])
    assert out[0][2] is None and torch.equal(out[1][2], x)
