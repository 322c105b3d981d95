"""In-memory group: results of every collective, copies, determinism, mismatches, timeouts, abort, point-to-point."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.collectives.util import run_ranks
from torch_dtorch.collectives import (
    CollectiveAborted,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
    Group,
    InMemoryComm,
    InMemoryWorld,
)
from torch_dtorch.collectives.local import chunk, reduce_tensors
from torch_dtorch.placement_rules.redistribute.simulate import reduce_tensors as sim_reduce

DEVICES = (0, 1, 2, 3)


def _world(devices=DEVICES, timeout_s: float = 20.0) -> InMemoryWorld:
    return InMemoryWorld(devices, timeout_s=timeout_s)


def _inputs(n: int, dim_sizes: list[int], *, dtype=torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for r, size in enumerate(dim_sizes[:n]):
        t = torch.randn(3, size, 2, generator=gen) * (r + 1)
        out.append(t.to(dtype))
    return out


def test_handle_is_a_group() -> None:
    g = _world().group(DEVICES).handle(2)
    assert isinstance(g, Group)
    assert (g.rank, g.size, g.devices) == (2, 4, DEVICES)


def test_all_gather_uneven_and_empty() -> None:
    world = _world()
    sizes = [3, 0, 2, 1]
    xs = _inputs(4, sizes)
    group = world.group(DEVICES)
    out = run_ranks(DEVICES, lambda d: group.handle(d).all_gather(xs[d], 1, sizes=sizes)).check()
    want = torch.cat(xs, dim=1)
    for d in DEVICES:
        assert torch.equal(out[d], want)
    assert len({out[d].data_ptr() for d in DEVICES}) == 4  # each rank its own copy
    assert all(out[d].data_ptr() != x.data_ptr() for d in DEVICES for x in xs)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("n", [4, 8])
def test_all_reduce_equals_plan_sim_bitwise(op: str, dtype: torch.dtype, n: int) -> None:
    """Same kernels as plan_sim, hence the same bits; with 8 ranks torch.stack(...).sum(0) is not a left-to-right
    sum, so this also pins that both keep using the same reduction."""
    devices = tuple(range(n))
    world = _world(devices)
    gen = torch.Generator().manual_seed(n)
    xs = [(torch.randn(3, 17, generator=gen) * 10 ** (r % 4)).to(dtype) for r in range(n)]
    group = world.group(devices)
    out = run_ranks(devices, lambda d: group.handle(d).all_reduce(xs[d], op)).check()
    want = sim_reduce(xs, op)
    for d in devices:
        assert out[d].dtype == dtype and torch.equal(out[d], want)
    out[0].add_(1)  # results do not alias each other
    assert torch.equal(out[1], want)


@pytest.mark.parametrize("op", ["sum", "max"])
def test_reduce_scatter_uneven(op: str) -> None:
    world = _world()
    xs = _inputs(4, [6] * 4)  # dim 1 of size 6 over 4 ranks: chunks 2, 2, 2, 0
    group = world.group(DEVICES)
    out = run_ranks(DEVICES, lambda d: group.handle(d).reduce_scatter(xs[d], op, -2)).check()
    total = reduce_tensors(xs, op)
    for d in DEVICES:
        assert torch.equal(out[d], chunk(total, 1, 4, d))
    assert out[3].shape == (3, 0, 2)


def test_all_to_all_uneven() -> None:
    world = _world((0, 1, 2))
    # S(1) -> S(0): dim 0 (size 5) is split 2,2,1; dim 1 sizes differ per rank
    xs = [torch.arange(5 * s * 1).reshape(5, s, 1) + 100 * r for r, s in enumerate([3, 3, 1])]
    group = world.group((0, 1, 2))
    out = run_ranks((0, 1, 2), lambda d: group.handle(d).all_to_all(xs[d], 1, 0)).check()
    for m in range(3):
        want = torch.cat([chunk(x, 0, 3, m) for x in xs], dim=1)
        assert torch.equal(out[m], want)
    assert [tuple(out[m].shape) for m in range(3)] == [(2, 7, 1), (2, 7, 1), (1, 7, 1)]


def test_broadcast_and_barrier() -> None:
    world = _world()
    x = torch.arange(6.0)
    group = world.group(DEVICES)

    def body(d: int) -> torch.Tensor:
        g = group.handle(d)
        g.barrier()
        return g.broadcast(x if d == 2 else None, 2)

    out = run_ranks(DEVICES, body).check()
    assert all(torch.equal(out[d], x) and out[d].data_ptr() != x.data_ptr() for d in DEVICES)


def test_overlapping_groups_many_rounds() -> None:
    """Rows and columns of a 2x2 mesh, interleaved for many rounds: every call meets its own slot."""
    world = _world()
    rows, cols = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}, {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}

    def body(d: int) -> list[float]:
        comm = InMemoryComm(world, d)
        seen = []
        for i in range(100):
            x = torch.tensor([float(d + i)])
            a = comm.group(rows[d]).all_reduce(x, "sum")
            b = comm.group(cols[d]).all_gather(a, 0)
            seen.append(float(b.sum()))
        return seen

    out = run_ranks(DEVICES, body).check()
    for i in range(100):
        # row sums (0+1+2i), (2+3+2i); every column gathers one of each
        assert {out[d][i] for d in DEVICES} == {1 + 2 * i + 5 + 2 * i}


def test_group_is_created_once_under_contention() -> None:
    world = _world(tuple(range(8)))
    barrier = threading.Barrier(8)

    def body(d: int) -> int:
        barrier.wait()
        return id(world.group((1, 3, 5)))

    out = run_ranks(range(8), body).check()
    assert len(set(out.values())) == 1


def test_mismatched_collectives_raise_on_every_member() -> None:
    world = _world((0, 1))
    group = world.group((0, 1))
    x = torch.ones(2)

    def body(d: int) -> torch.Tensor:
        g = group.handle(d)
        return g.all_reduce(x) if d == 0 else g.all_gather(x, 0)

    out = run_ranks((0, 1), body)
    assert set(out.errors) == {0, 1}
    assert all(isinstance(e, CollectiveMismatchError) for e in out.errors.values())
    assert "all_reduce(op=sum)" in str(out.errors[1]) and "all_gather(dim=0)" in str(out.errors[1])
    # the group stays usable: the members are still in step
    again = run_ranks((0, 1), lambda d: group.handle(d).all_reduce(x)).check()
    assert torch.equal(again[0], 2 * x)


def test_bad_shapes_raise_typed_error_on_every_member() -> None:
    world = _world((0, 1))
    group = world.group((0, 1))
    out = run_ranks((0, 1), lambda d: group.handle(d).all_reduce(torch.ones(d + 1)))
    assert set(out.errors) == {0, 1}
    assert all(isinstance(e, CollectiveMismatchError) and "(1,), (2,)" in str(e) for e in out.errors.values())


def test_timeout_names_group_op_and_arrivals() -> None:
    world = _world(timeout_s=0.3)
    group = world.group(DEVICES)
    start = time.monotonic()
    out = run_ranks((0, 1, 3), lambda d: group.handle(d).all_reduce(torch.ones(1), "max"))
    assert time.monotonic() - start < 2.0
    assert set(out.errors) == {0, 1, 3}
    for err in out.errors.values():
        assert isinstance(err, CollectiveTimeout) and isinstance(err, TimeoutError)
        assert err.devices == DEVICES and err.op == "all_reduce" and err.missing == (2,)
        assert (
            "(0, 1, 2, 3)" in str(err)
            and "all_reduce(op=max)" in str(err)
            and "never arrived [2]" in str(err)
        )
    # the group is broken: a late member fails at once instead of waiting
    late = run_ranks((2,), lambda d: group.handle(d).all_reduce(torch.ones(1)))
    assert isinstance(late.errors[2], CollectiveTimeout)


def test_timeout_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTORCH_COLLECTIVE_TIMEOUT_S", "0.2")
    world = InMemoryWorld((0, 1))
    assert world.timeout_s == 0.2
    start = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"never arrived \[1\]"):
        world.group((0, 1)).handle(0).barrier()
    assert time.monotonic() - start < 1.0
    monkeypatch.setenv("DTORCH_COLLECTIVE_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="DTORCH_COLLECTIVE_TIMEOUT_S"):
        InMemoryWorld((0, 1))


def test_abort_wakes_waiters_and_fails_later_calls() -> None:
    world = _world()
    group = world.group(DEVICES)
    comm = InMemoryComm(world, 3)
    threading.Timer(0.2, world.abort, args=("worker 1 failed",)).start()
    start = time.monotonic()

    def body(d: int) -> object:
        if d == 3:
            return comm.recv(1, tag=5)
        return group.handle(d).all_reduce(torch.ones(1))

    out = run_ranks((0, 2, 3), body)
    assert time.monotonic() - start < 2.0
    assert set(out.errors) == {0, 2, 3}
    assert all(isinstance(e, CollectiveAborted) and "worker 1 failed" in str(e) for e in out.errors.values())
    assert world.aborted
    with pytest.raises(CollectiveAborted):
        world.group((0, 1)).handle(0).barrier()  # a group created after the abort
    with pytest.raises(CollectiveAborted):
        comm.send(torch.ones(1), 0)
    world.abort("twice is fine")


def test_point_to_point_order_tags_and_copies() -> None:
    world = _world((0, 1))
    sender, receiver = InMemoryComm(world, 0), InMemoryComm(world, 1)
    x = torch.zeros(2)
    sender.send(x, 1, tag=1).wait()
    x.add_(1)  # the message is a copy
    sender.send(x, 1, tag=1)
    sender.send(torch.full((1,), 7.0), 1, tag=2)
    assert torch.equal(receiver.recv(0, tag=2), torch.full((1,), 7.0))
    assert torch.equal(receiver.recv(0, tag=1), torch.zeros(2))
    assert torch.equal(receiver.recv(0, tag=1), torch.ones(2))
    empty = torch.empty(0, 3)
    sender.send(empty, 1)
    assert receiver.recv(0).shape == (0, 3)
    with pytest.raises(CollectiveTimeout, match="tag=9"):
        world.recv(0, 1, tag=9, timeout_s=0.05)


def test_invalid_groups_and_devices() -> None:
    world = _world((0, 1))
    with pytest.raises(CollectiveError):
        world.group((0, 5))
    with pytest.raises(CollectiveError):
        world.group((0, 0))
    with pytest.raises(CollectiveError):
        world.group((0, 1)).handle(7)
    with pytest.raises(CollectiveError):
        InMemoryComm(world, 4)
    with pytest.raises(ValueError, match="reduce op"):
        world.group((0,)).handle(0).all_reduce(torch.ones(1), "prod")


def test_empty_tensors_through_every_collective() -> None:
    world = _world((0, 1))
    group = world.group((0, 1))

    def body(d: int) -> list[torch.Tensor]:
        g = group.handle(d)
        e = torch.empty(0, 4)
        return [
            g.all_gather(e, 0),
            g.all_reduce(e, "max"),
            g.reduce_scatter(e, "sum", 0),
            g.all_to_all(e, 1, 0),
            g.broadcast(e, 0),
        ]

    out = run_ranks((0, 1), body).check()
    assert [tuple(t.shape) for t in out[1]] == [(0, 4), (0, 4), (0, 4), (0, 8), (0, 4)]
