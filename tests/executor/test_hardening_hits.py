"""Hardening (issue 18, deliverable 2): the memory pre-check covers the eager fast path's hits. A loop of hits whose
outputs stay alive fails with ``DeviceMemoryError`` in the call that does not fit (before it is recorded, the mesh
and every tensor still usable); a loop whose outputs die never fails, because the check settles (frees the dead,
waits for the workers) before it fails."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.distributed.tensor import Shard

import torch_dtorch as dt
from torch_dtorch.device import fastpath
from torch_dtorch.errors import DeviceMemoryError
from torch_dtorch.executor.memory_check import MemoryGuard, MemoryPool

_ROWS = 64  # x: float32[64, 64], Shard(0) on 2 devices: 8 KiB per device, 16 KiB per op output in the pool


def _live_bytes() -> int:
    """Bytes of the tensors the thread-mode workers hold (each storage once)."""
    runner = dt.device.state.get_session().executor.runner
    seen: dict[int, int] = {}
    for w in runner.workers.values():
        for b in list(w.blobs.values()):
            if b.tensor is not None:
                st = b.tensor.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@pytest.fixture
def small_pool() -> Iterator[tuple[MemoryGuard, torch.Tensor, int]]:
    """A 2-device CPU mesh whose pool has room for 8 more op outputs than it holds now: a fake free figure that
    falls as the workers allocate (what MemAvailable does, on a small scale)."""
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(_ROWS, 64), mesh, [Shard(0)])
    (x + 1).full_tensor()  # the fast path learns x + 1 (later calls are hits)
    dt.sync()
    ex = dt.device.state.get_session().executor
    limit = _live_bytes() + 8 * _ROWS * 64 * 4
    guard = MemoryGuard(
        [MemoryPool("fake RAM", tuple(mesh.devices), lambda: limit - _live_bytes())],
        margin=0.0,
        settle=ex.sync,
        catch_up=ex.release_to_ledger,
    )
    old = ex.constructor.memory
    ex.constructor.memory = guard
    try:
        yield guard, x, 8
    finally:
        ex.constructor.memory = old


def test_hits_whose_outputs_stay_alive_fail_before_exhausting_memory(
    small_pool: tuple[MemoryGuard, torch.Tensor, int],
) -> None:
    guard, x, room = small_pool
    ex = dt.device.state.get_session().executor
    hits = fastpath.stats["hit"]
    kept = []
    with pytest.raises(DeviceMemoryError) as e:
        for _ in range(4 * room):
            kept.append(x + 1)
    assert fastpath.stats["hit"] - hits == len(kept)  # every call was a fast-path hit
    assert len(kept) == room  # the (room + 1)-th did not fit, however the planned bytes were counted
    assert guard.settles >= 1  # and it failed only after settling
    err = e.value
    assert isinstance(err, torch.OutOfMemoryError) and err.op == "aten.add.Tensor" and err.pool == "fake RAM"
    assert "output 0: float32[64, 64] S(0)" in str(err) and "Nothing was sent" in str(err)
    # the failing call recorded nothing; the mesh and every tensor are still usable
    next_id = ex.constructor.graph._next_operand
    with pytest.raises(DeviceMemoryError):
        x + 1
    assert ex.constructor.graph._next_operand == next_id
    for y in kept:
        torch.testing.assert_close(y.full_tensor(), x.full_tensor() + 1)
    del kept[:]
    torch.testing.assert_close((x + 1).full_tensor(), x.full_tensor() + 1)  # fits again once they died


def test_hits_whose_outputs_die_do_not_fail(small_pool: tuple[MemoryGuard, torch.Tensor, int]) -> None:
    guard, x, room = small_pool
    hits = fastpath.stats["hit"]
    y = x + 1
    for _ in range(10 * room):
        y = x + 1  # the previous y dies
    assert fastpath.stats["hit"] - hits == 10 * room + 1
    # each dead output's bytes are forgotten with it (memory_ledger.py): nothing piles up, nothing settles
    assert guard.settles == 0
    torch.testing.assert_close(y.full_tensor(), x.full_tensor() + 1)


def test_hit_bytes_are_worked_out_once_per_plan(small_pool: tuple[MemoryGuard, torch.Tensor, int]) -> None:
    guard, x, _ = small_pool
    y = x + 1
    mems = [
        tpl.plan.mem
        for fast in fastpath._FAST.values()
        if fast is not None
        for tpl in fast.cache.values()
        if tpl.plan.mem is not None and tpl.plan.mem.guard is guard
    ]
    assert [m.per_pool for m in mems] == [((0, _ROWS * 64 * 4),)]  # one plan (x + 1), both devices in pool 0
    z = x + 1
    assert [tpl.plan.mem for fast in fastpath._FAST.values() if fast for tpl in fast.cache.values()].count(
        mems[0]
    ) == 1  # the same object: not worked out again
    del y, z


def test_the_ledger_learns_of_dead_outputs_at_each_flush(
    small_pool: tuple[MemoryGuard, torch.Tensor, int],
) -> None:
    """A dead output's ``Free`` goes out in front of the next op (the workers drop it there), but the memory guard's
    ledger is told of the dead once per flush, not once per op: until then their bytes still count as planned, and a
    hit past the budget first tells it (above: no settle)."""
    guard, x, room = small_pool
    ex = dt.device.state.get_session().executor
    dt.sync()
    assert not ex._unledgered
    y = x + 1
    for _ in range(room // 2):
        y = x + 1  # the previous y dies
    frees = [i for i in ex._pending if type(i).__name__ == "Free"]
    assert len(frees) >= room // 2 - 1  # a Free in front of (nearly) every op: per op, not batched
    assert len(ex._unledgered) >= room // 2 - 1
    assert guard.planned_bytes[0] >= (room // 2) * _ROWS * 64 * 4  # the dead still count until the flush
    ex.flush()
    assert not ex._unledgered
    assert guard.planned_bytes[0] <= 2 * _ROWS * 64 * 4  # only the live y (and one not yet drained)
    torch.testing.assert_close(y.full_tensor(), x.full_tensor() + 1)


def test_general_path_ops_whose_outputs_die_do_not_settle_either(
    small_pool: tuple[MemoryGuard, torch.Tensor, int],
) -> None:
    """The general check (an op planned in full, not a fast-path hit) asks the executor to tell the ledger of the
    dead before it settles, as a hit does: a loop of such ops whose outputs die never waits for the workers (the
    ledger learns of the dead per flush)."""
    from torch_dtorch.device.dispatch import operand_of

    guard, x, room = small_pool
    ex = dt.device.state.get_session().executor
    xop = operand_of(x)
    checks = guard.checks
    for _ in range(4 * room):
        out = ex.call(torch.ops.aten.add.Tensor, xop, xop)  # the executor's general entry: planned, checked
        ex.release(out.id)  # its tensor died
    assert guard.checks - checks == 4 * room  # every call was checked
    assert guard.settles == 0
