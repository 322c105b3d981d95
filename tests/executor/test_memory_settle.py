"""The memory pre-check of planned calls and uploads settles before it fails (found on an H100, 2026-12-06).

Bytes planned since the workers were last seen idle may be allocated by the time the check reads a free figure,
and then they count twice. Uploading a FLUX.1-dev transformer's weights while a GPU worker was busy raised a false
``DeviceMemoryError`` ("72 MiB + 16.12 GiB planned and not yet allocated, 17.97 GiB free") although everything fit:
the check now settles (flushes, frees the dead, waits for the workers) and looks again, failing only then.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import torch_dtorch as dt
from tests.executor.test_hardening_hits import _live_bytes
from torch_dtorch import Replicate, Shard
from torch_dtorch.errors import DeviceMemoryError
from torch_dtorch.executor.memory_check import MemoryGuard, MemoryPool

_BLOCK = 32 * 1024  # bytes of one float32[64, 128] Replicate upload per device


@pytest.fixture
def busy_pool() -> Iterator[tuple[MemoryGuard, dt.DeviceMesh, int]]:
    """A 2-device mesh whose fake pool has room for 10 more uploads than it holds now, and whose workers never
    look idle to the check (a GPU worker busy with earlier work), so planned bytes are never forgotten early."""
    mesh = dt.init_device_mesh("cpu", (2,))
    dt.sync()
    ex = dt.device.state.get_session().executor
    limit = _live_bytes() + 10 * 2 * _BLOCK
    guard = MemoryGuard(
        [MemoryPool("fake RAM", tuple(mesh.devices), lambda: limit - _live_bytes())],
        margin=0.0,
        idle=lambda: False,
        settle=ex.sync,
        catch_up=ex.release_to_ledger,
    )
    old = ex.constructor.memory
    ex.constructor.memory = guard
    try:
        yield guard, mesh, 10
    finally:
        ex.constructor.memory = old


def test_the_executor_guard_settles_through_sync() -> None:
    dt.init_device_mesh("cpu", (2,))
    ex = dt.device.state.get_session().executor
    guard = ex.constructor.memory
    assert guard is not None and guard._settle == ex.sync


def test_uploads_that_fit_do_not_fail_while_the_workers_are_busy(
    busy_pool: tuple[MemoryGuard, dt.DeviceMesh, int],
) -> None:
    guard, mesh, room = busy_pool
    kept = []
    for k in range(room):  # every upload fits; without settling, the planned bytes double-count the live ones
        t = torch.full((64, 128), float(k))
        kept.append((dt.distribute_tensor(t, mesh, [Replicate()]), t))
        dt.sync()  # the workers allocate it: the free figure shows it while it is still counted as planned
    assert guard.settles >= 1
    for x, t in kept:
        torch.testing.assert_close(dt.to_torch(x), t)


def test_uploads_that_do_not_fit_still_fail_and_lose_nothing(
    busy_pool: tuple[MemoryGuard, dt.DeviceMesh, int],
) -> None:
    guard, mesh, room = busy_pool
    kept = [dt.distribute_tensor(torch.full((64, 128), float(k)), mesh, [Replicate()]) for k in range(room)]
    with pytest.raises(DeviceMemoryError, match=r"upload: not enough memory on fake RAM"):
        dt.distribute_tensor(torch.zeros(64, 128), mesh, [Replicate()])
    for k, x in enumerate(kept):
        assert float(dt.to_torch(x)[0, 0]) == float(k)


def test_planned_outputs_that_fit_do_not_fail_while_the_workers_are_busy(
    busy_pool: tuple[MemoryGuard, dt.DeviceMesh, int],
) -> None:
    """The same on the planning path: a new shape every call (planned in full), outputs kept."""
    guard, mesh, room = busy_pool
    a = torch.randn(64, 128)
    x = dt.distribute_tensor(a, mesh, [Replicate()])  # one upload's bytes of the room
    outs = []
    for k in range(room - 1):  # 9 outputs of a little under one upload's bytes each: they fit
        outs.append((x[:, : 128 - k] * 2.0, k))  # [64, 128 - k]: a new shape each call, planned in full
        dt.sync()
    assert guard.settles >= 1
    for y, k in outs:
        torch.testing.assert_close(dt.to_torch(y), a[:, : 128 - k] * 2.0)


@pytest.mark.parametrize("with_progress", [True, False])
def test_finished_batches_are_forgotten_without_settling(with_progress: bool) -> None:
    """Hits whose outputs stay alive, while the workers never look idle (a GPU worker with a long queue): the bytes
    of batches every worker has run show in the live figure, so they are forgotten (``progress``) instead of being
    counted twice until the check settles -- which drains the GPU. Without progress the same loop settles."""
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    (x + 1).full_tensor()
    dt.sync()
    ex = dt.device.state.get_session().executor
    runner = ex.runner
    limit = _live_bytes() + 48 * 64 * 64 * 4  # room for 48 outputs of x + 1 (both shards)
    guard = MemoryGuard(
        [MemoryPool("fake RAM", tuple(mesh.devices), lambda: limit - _live_bytes())],
        margin=0.0,
        idle=lambda: False,
        settle=ex.sync,
        catch_up=ex.release_to_ledger,
        progress=runner.finished_batches if with_progress else None,
    )
    old = ex.constructor.memory
    ex.constructor.memory = guard
    kept = []
    try:
        for _ in range(30):  # 30 outputs alive: in the figure once allocated, and in the planned bytes
            kept.append(x + 1)
            ex.flush()
            assert runner.wait_idle(10)
        # room for 18 more: these 10 fit, unless the 30 count twice (planned and allocated)
        kept.append(dt.ones(64, 640, device_mesh=mesh, placements=[Shard(0)]))
        assert (guard.settles == 0) if with_progress else (guard.settles >= 1)
        assert runner.finished_batches() == runner.batches
    finally:
        ex.constructor.memory = old
        del kept


def test_dying_planned_outputs_do_not_pile_up_the_hits_bytes() -> None:
    """Each step has hits and a call checked on the planning path (tracked per operand) whose outputs die, while
    the GPU runs a few batches behind. The release of a tracked operand used to clear the finished-batch marks, so
    with a queue deeper than one batch the hits' bytes were never forgotten and piled up until the check settled --
    several times per eager FLUX pipeline step on an H100 (2026-12-06), each settle draining the GPU. Released
    tracked bytes now lower the marks that counted them instead."""
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    (x + 1).full_tensor()
    dt.sync()
    ex = dt.device.state.get_session().executor
    runner = ex.runner
    step = 64 * 64 * 4 * 3 + 64 * 40 * 4  # bytes one step plans (at most)
    limit = _live_bytes() + 8 * step
    guard = MemoryGuard(
        [MemoryPool("fake RAM", tuple(mesh.devices), lambda: limit - _live_bytes())],
        margin=0.0,
        idle=lambda: False,
        settle=ex.sync,
        catch_up=ex.release_to_ledger,
        progress=lambda: max(0, runner.finished_batches() - 3),  # a GPU queue three batches deep
    )
    old = ex.constructor.memory
    ex.constructor.memory = guard
    try:
        for i in range(40):
            y = x + 1  # hits
            z = y * 2
            w = dt.ones(64, 64 + i, device_mesh=mesh, placements=[Shard(0)])  # planned: checked and tracked
            del w, y, z
            ex.flush()
            assert runner.wait_idle(10)
        assert guard.settles == 0
        assert guard.planned()["fake RAM"] <= 5 * step  # the last few steps', not all forty
    finally:
        ex.constructor.memory = old


def test_released_bytes_are_not_forgotten_twice() -> None:
    """A tracked operand whose batch finished is forgotten with the mark; its later death must not lower the
    planned bytes again (that would hide bytes planned after it from the check)."""
    pool = MemoryPool("fake", (0,), lambda: 1 << 30)
    done = [0]
    guard = MemoryGuard([pool], margin=0.0, idle=lambda: False, progress=lambda: done[0])
    guard.check("a", [("a", {0: 100})])
    guard.track(1, {0: 100})
    guard.flushed(1)  # batch 1 holds operand 1
    guard.check("b", [("b", {0: 50})])
    guard.track(2, {0: 50})
    done[0] = 1
    with guard._lock:
        guard._refresh()  # batch 1 ran: its 100 bytes are forgotten
    assert guard.planned() == {"fake": 50}
    guard.released([1])  # operand 1 dies: already forgotten
    assert guard.planned() == {"fake": 50}
    guard.released([2])
    assert guard.planned() == {"fake": 0}


def test_reported_figures_forget_the_bytes_of_dead_hit_outputs() -> None:
    """A worker process reports its free memory with the values it sends back; busy with a stream of batches it
    reports nothing. The bytes of hits whose outputs died used to pile up until the check settled (17 times per
    eager FLUX step in process mode on an H100, 2026-12-06); they are now tied to the output and forgotten with
    it, while live outputs still count."""
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(64, 64), mesh, [Shard(0)])
    (x + 1).full_tensor()
    dt.sync()
    ex = dt.device.state.get_session().executor
    out_bytes = 64 * 64 * 4
    free = _live_bytes() + 8 * out_bytes
    guard = MemoryGuard(
        [
            MemoryPool("reported", tuple(mesh.devices), lambda: free, generation=lambda: 0)
        ],  # never a new report
        margin=0.0,
        settle=ex.sync,
        catch_up=ex.release_to_ledger,
    )
    old = ex.constructor.memory
    ex.constructor.memory = guard
    try:
        for _ in range(40):  # 40 outputs' bytes in all, 1 alive at a time
            y = x + 1
            del y
        ex.flush()
        assert guard.settles == 0
        kept = [x * 2 for _ in range(5)]  # live outputs stay counted
        ex.flush()
        assert guard.planned()["reported"] >= 5 * out_bytes
        del kept
    finally:
        ex.constructor.memory = old
