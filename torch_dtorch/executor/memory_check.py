"""Memory pre-check: an allocation that cannot fit raises :class:`~torch_dtorch.errors.DeviceMemoryError` (a
``torch.OutOfMemoryError``) on the controller, in the caller, **before anything is sent**, instead of a worker (or,
in thread mode, the controller itself) being OOM-killed.

What is checked (on the planning path: every call the eager fast path has not cached, every factory such as
``dt.ones(..., placements=...)``, every upload, every explicit redistribute):

* the outputs an op's rule plans (not views, not in-place outputs: they allocate nothing), the copies of inputs it
  redistributes, the buffers of an explicit redistribute, the shards of an upload;
* per **memory pool**: the memory devices share. CPU devices of one host share its RAM (``MemAvailable`` of
  ``/proc/meminfo``, read at each check); virtual CUDA ranks share their GPU; a CUDA device's free figure is
  ``torch.cuda.mem_get_info`` plus what the caching allocator holds unused (:func:`cuda_free_bytes`), read by the
  controller (thread mode) or reported by the worker process (when ready and with every value it sends back;
  process mode);
* the need is the sum over the pool's devices of each one's local shard bytes, plus the bytes already planned
  since the workers were last seen idle (they may not be allocated yet: a running estimate, lowered when those
  tensors die), against the free figure less a safety margin: ``DTORCH_MEMORY_MARGIN`` (a fraction of the free
  memory kept back, default ``0.1``). Those planned bytes may already be allocated (and then counted twice: the
  workers are busy with the earlier work, so never seen idle), so where a call does not fit while bytes are planned,
  the check **settles** first -- flushes, frees the dead tensors, waits for the workers -- and fails only if a fresh
  figure does not allow it either (a stream of weight uploads to a busy GPU raised falsely before, 2026-12-06).
  In thread mode the bytes planned before a batch every worker has run are forgotten at the next figure
  (:meth:`MemoryGuard.flushed`): a busy GPU worker is never idle, and settling drains its queue. Every counted byte
  belongs to an operand, and goes when it dies (its buffer is freed in stream order before any later allocation),
  when its batch ran, or with a new figure -- once (:mod:`torch_dtorch.executor.memory_ledger`).

Fast-path hits (a call the eager fast path replays) are checked too, cheaply: the plan knows its new bytes per pool
(outputs that are not views, redistributed input copies), worked out at its first hit; each hit adds them to the
pool's planned bytes (:meth:`MemoryGuard.hit`, a few integer adds), ties them to its output (they go when it dies:
an eager step's activations never pile up) and compares them with what the last free figure allows. Past it, the check reads a fresh figure (:meth:`MemoryGuard.recheck`); if that does not allow the hit
either, the executor **settles** -- flushes, frees the dead tensors and waits until the workers ran everything, so
the figure shows exactly what is alive -- and checks once more (:meth:`MemoryGuard.settle`), failing only then. A
loop whose outputs die therefore never fails; one that keeps them fails in the call that would not fit.

The pools, their free figures and the shard byte counts live in :mod:`torch_dtorch.executor.memory_pools`.

What is **not** checked: kernels' own temporary workspace, the compile backend's programs, and remote CPU workers
(no figure until one is reported).
``DTORCH_MEMORY_CHECK=0`` turns the check off. Nothing is queued when the check fails: the mesh and every other
tensor stay usable.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch_dtorch.errors_oom import DeviceMemoryError
from torch_dtorch.executor.memory_ledger import PlannedLedger
from torch_dtorch.executor.memory_pools import (
    MemoryPool,
    check_enabled,
    cuda_free_bytes,
    env_margin,
    gib,
    host_available_bytes,
    operand_bytes,
    pool_free_of_cuda,
    shard_bytes,
)
from torch_dtorch.graph import Operand
from torch_dtorch.placement import placements_str

__all__ = [
    "HitBytes",
    "MemoryGuard",
    "MemoryPool",
    "cuda_free_bytes",
    "host_available_bytes",
    "memory_guard_for",
    "operand_bytes",
    "shard_bytes",
]

log = logging.getLogger(__name__)
#: a free-memory figure younger than this is reused for allocations under a quarter of it
_FIGURE_TTL_S = 0.2


class HitBytes:
    """What one fast-path hit allocates (:meth:`MemoryGuard.plan_bytes`): ``per_pool``, ``(pool index, bytes)`` of
    every pool it allocates on; ``pool``/``nbytes`` the same when that is one pool (``pool`` ``-1``: several, or
    none with ``nbytes`` 0); ``labels``, each new tensor's description and bytes per device (for the error)."""

    __slots__ = ("guard", "per_pool", "pool", "nbytes", "labels")

    def __init__(
        self,
        guard: MemoryGuard,
        per_pool: tuple[tuple[int, int], ...],
        labels: tuple[tuple[str, dict[int, int]], ...],
    ) -> None:
        self.guard = guard
        self.per_pool = per_pool
        self.pool = per_pool[0][0] if len(per_pool) == 1 else -1
        self.nbytes = sum(n for _, n in per_pool)
        self.labels = labels


class MemoryGuard:
    """The controller's memory pre-check (see the module docstring).

    Args:
        pools: the memory pools of the runner's devices.
        margin: fraction of a pool's free memory kept back (default ``DTORCH_MEMORY_MARGIN``).
        idle: whether the workers ran everything sent so far (then nothing planned is still unallocated).
        progress: how many submitted batches every worker has run (the runner's ``finished_batches``): the bytes
            planned before a finished batch are allocated, so a live figure shows them (see :meth:`flushed`).
        settle: flush, free the dead tensors and wait until the workers ran everything (the executor's ``sync``):
            where :meth:`check` finds too little room while bytes are planned but maybe not yet allocated, it
            settles, so the free figure is the whole truth, and checks once more before it fails.
    """

    def __init__(
        self,
        pools: Sequence[MemoryPool],
        *,
        margin: float | None = None,
        idle: Callable[[], bool] | None = None,
        settle: Callable[[], None] | None = None,
        progress: Callable[[], int] | None = None,
        catch_up: Callable[[], None] | None = None,
    ) -> None:
        self.pools = tuple(pools)
        self.margin = env_margin() if margin is None else margin
        self._idle = idle
        self._settle = settle
        #: tells the ledger of the operands that died since the executor's last flush (it learns of them per
        #: flush: ``EagerGraphExecutor.release_to_ledger``) before a hit past the budget reads a fresh figure
        #: (:meth:`recheck`) and before a check settles
        self._catch_up = catch_up
        self._progress = progress
        self._pool_of = {d: i for i, p in enumerate(self.pools) for d in p.devices}
        #: what is counted as planned, and what it belongs to (torch_dtorch/executor/memory_ledger.py; the fast
        #: path ties a hit's bytes to its output: ``PlannedLedger.track_hit``)
        self.ledger = PlannedLedger([p.generation is None for p in self.pools])
        #: per pool, bytes planned since the free figure last showed them (a fast-path hit adds to it inline:
        #: ``PlannedRecorder.record_fast``; the ledger's list, only ever changed in place)
        self.planned_bytes = self.ledger.planned
        self._generations = [p.generation() if p.generation is not None else 0 for p in self.pools]
        self._last_free: list[tuple[int | None, float]] = [(None, 0.0)] * len(self.pools)
        #: per pool, what the last free figure allows (free less the margin; -1 before the first figure): a
        #: fast-path hit passes while the planned bytes stay under it
        self.budget: list[float] = [-1.0] * len(self.pools)
        self._lock = threading.Lock()
        self.checks = 0
        #: how often a fast-path hit made the executor settle (tests, diagnostics)
        self.settles = 0

    def check(self, what: str, tensors: Iterable[tuple[str, dict[int, int]]]) -> None:
        """Raise :class:`DeviceMemoryError` if the new ``tensors`` (each a description and its bytes per device)
        do not fit; else count them as planned (:meth:`track` ties them to their operand). ``what`` names the call
        (``aten.ones.default``, ``upload``, ``redistribute``)."""
        items = [(x, per) for x, per in tensors if per]
        if not items or not self.pools:
            return
        self.checks += 1
        need = [0] * len(self.pools)
        for _, per in items:
            for d, n in per.items():
                i = self._pool_of.get(d)
                if i is not None:
                    need[i] += n
        with self._lock:
            short = self._short(need)
            if short is None:
                for i, n in enumerate(need):
                    self.planned_bytes[i] += n
                return
            i, free = short
            if self._settle is None or need[i] > free * (1.0 - self.margin):  # settling would not make room
                raise self._error(what, items, self.pools[i], need[i], free, self.planned_bytes[i])
        # first the bytes of the operands dead since the last flush (outside the lock: the executor's)
        if self._catch_up is not None:
            self._catch_up()
            with self._lock:
                if self._short(need) is None:
                    for i, n in enumerate(need):
                        self.planned_bytes[i] += n
                    return
        # Bytes planned since the workers were last seen idle may be allocated already, and then the free figure
        # counts them twice: settle (outside the lock: the executor's sync frees dead tensors through it), so
        # nothing planned is unallocated, and look again.
        self._settle_now()
        with self._lock:
            short = self._short(need)
            if short is not None:
                i, free = short
                raise self._error(what, items, self.pools[i], need[i], free, self.planned_bytes[i])
            for i, n in enumerate(need):
                self.planned_bytes[i] += n

    def _short(self, need: list[int]) -> tuple[int, int] | None:
        """The first pool (and its free bytes) where ``need`` does not fit next to the planned bytes; ``None``
        where it fits everywhere (callers hold the lock)."""
        now = time.monotonic()
        refreshed = False
        for i, pool in enumerate(self.pools):
            if not need[i]:
                continue
            free, at = self._last_free[i]
            # a small allocation next to a recent figure needs no new one (reading one costs ~15 us)
            if free is None or now - at > _FIGURE_TTL_S or need[i] + self.planned_bytes[i] > free / 4:
                if not refreshed:
                    self._refresh()
                    refreshed = True
                free = pool.free()
                self._last_free[i] = (free, now)
                self.budget[i] = math.inf if free is None else free * (1.0 - self.margin)
            if free is None:
                continue
            if need[i] > free * (1.0 - self.margin) - self.planned_bytes[i]:
                return i, free
        return None

    # --- fast-path hits (see the module docstring) ----------------------------------------------------------
    def plan_bytes(self, plan: Any, inputs: Sequence[Operand | None]) -> HitBytes:
        """What one hit of ``plan`` (a :class:`~torch_dtorch.executor.fast.FastPlan`) allocates per pool of this
        guard, with a description of each new tensor (for the error); kept on the plan (``plan.mem``)."""
        labels: list[tuple[str, dict[int, int]]] = []
        for slot, _, spec in plan.moves:
            x = inputs[slot]
            if x is not None:
                out_root = spec.out_mesh.root
                per = shard_bytes(
                    x.shape, x.dtype, out_root, spec.out_mesh.to_root_placements(spec.out_placements)
                )
                labels.append((f"copy of input {slot} as {placements_str(spec.out_placements)}", per))
        if (
            plan.view_of is None and plan.written is None and not plan.rule.writes_inputs
        ):  # (in place: no bytes)
            for k, (shape, dtype, mesh, pl, _, _) in enumerate(plan.outs):
                if mesh is not None:
                    per = shard_bytes(shape, dtype, mesh.root, mesh.to_root_placements(pl))
                    name = str(dtype).removeprefix("torch.")
                    labels.append((f"output {k}: {name}{list(shape)} {placements_str(pl)}", per))
        need = [0] * len(self.pools)
        for _, per in labels:
            for d, n in per.items():
                i = self._pool_of.get(d)
                if i is not None:
                    need[i] += n
        mem = HitBytes(self, per_pool=tuple((i, n) for i, n in enumerate(need) if n), labels=tuple(labels))
        plan.mem = mem
        return mem

    def hit(self, mem: HitBytes) -> bool:
        """Count one fast-path hit's bytes as planned; ``False`` (nothing counted) where that would pass what the
        last free figure allows: then :meth:`recheck`. Lock-free (an estimate, like the planned bytes)."""
        planned = self.planned_bytes
        budget = self.budget
        for i, n in mem.per_pool:
            if planned[i] + n > budget[i]:
                return False
        for i, n in mem.per_pool:
            planned[i] += n
        return True

    def recheck(self, mem: HitBytes) -> bool:
        """A hit past the last figure: count it and return ``True`` if it fits once the ledger caught up with the
        dead, or else fresh figures allow it."""
        if self._catch_up is not None:
            self._catch_up()
            if self.hit(mem):
                return True
        with self._lock:
            self._refresh()
            return self._admit(mem, settled=False)

    def settle(self, what: str, mem: HitBytes) -> None:
        """A hit the fresh figures do not allow either: settle, so nothing planned is unallocated and a fresh
        figure is the whole truth; then count the hit, or raise :class:`DeviceMemoryError`."""
        self._settle_now()
        with self._lock:
            self._admit(mem, settled=True, what=what)

    def _settle_now(self) -> None:
        """Settle through the ``settle`` callback (the executor's ``sync``: flush, free the dead tensors, wait for the
        workers), then forget every planned byte. Callers do not hold the lock (the sync frees tensors through
        :meth:`released`)."""
        if self._settle is not None:
            self._settle()
        with self._lock:
            self.settles += 1
            self.ledger.clear()
            self._last_free = [(None, 0.0)] * len(self.pools)

    def _admit(self, mem: HitBytes, *, settled: bool, what: str = "") -> bool:
        # callers hold the lock
        now = time.monotonic()
        fresh: dict[int, int | None] = {}
        for i, _ in mem.per_pool:
            free = self.pools[i].free()
            self._last_free[i] = (free, now)
            self.budget[i] = math.inf if free is None else free * (1.0 - self.margin)
            fresh[i] = free
        for i, n in mem.per_pool:
            if self.planned_bytes[i] + n > self.budget[i]:
                if not settled:
                    return False
                free = fresh[i]
                assert free is not None
                raise self._error(what, list(mem.labels), self.pools[i], n, free, self.planned_bytes[i])
        self.checks += 1
        for i, n in mem.per_pool:
            self.planned_bytes[i] += n
        return True

    def track(self, operand_id: int, per_device: dict[int, int]) -> None:
        """``operand_id`` holds bytes :meth:`check` counted: its death lowers the planned bytes again."""
        counted = [(i, n) for d, n in per_device.items() if (i := self._pool_of.get(d)) is not None and n]
        if counted:
            with self._lock:
                self.ledger.track(operand_id, tuple(counted))

    def flushed(self, batch: int) -> None:
        """The executor submitted batch number ``batch`` (the runner's count): every byte planned so far is in it
        or an earlier one. Once the workers ran it (``progress() >= batch``), a live figure shows those bytes, and
        :meth:`_refresh` forgets them without waiting for the workers to be idle (a GPU worker with a long queue
        is never idle). Thread mode's figures are live; process mode's are reports (forgotten per report)."""
        if self._progress is None or not any(self.planned_bytes):
            return
        with self._lock:
            self.ledger.mark(batch)

    def _refresh(self) -> None:
        """Forget the planned bytes the free figures show by now (callers hold the lock)."""
        ledger = self.ledger
        live_idle: bool | None = None
        for i, pool in enumerate(self.pools):
            if not self.planned_bytes[i]:
                continue
            if pool.generation is not None:
                g = pool.generation()
                if g != self._generations[i]:
                    self._generations[i] = g
                    ledger.forget_pool(i)
            else:
                if live_idle is None:
                    live_idle = self._idle is not None and self._idle()
                    if not live_idle and self._progress is not None and ledger.has_marks:
                        ledger.forget_finished(self._progress())
                if live_idle:
                    ledger.forget_pool(i)
        if not any(self.planned_bytes):
            ledger.clear()

    def planned(self) -> dict[str, int]:
        """Bytes planned per pool that its free figure may not show yet (diagnostics)."""
        with self._lock:
            return {p.name: n for p, n in zip(self.pools, self.planned_bytes, strict=True)}

    @property
    def tracking(self) -> bool:
        """Whether any live operand is counted as planned (else :meth:`released` has nothing to do)."""
        return self.ledger.tracking

    def released(self, operand_ids: Iterable[int]) -> None:
        """``operand_ids`` died: what they were counted for is no longer planned."""
        if not self.ledger.tracking:
            return
        with self._lock:
            self.ledger.released(operand_ids)

    def _error(
        self,
        what: str,
        items: list[tuple[str, dict[int, int]]],
        pool: MemoryPool,
        need: int,
        free: int,
        planned: int,
    ) -> DeviceMemoryError:
        lines = []
        for x, per in items:
            mine = {d: n for d, n in per.items() if d in pool.devices}
            if mine:
                each = sorted(set(mine.values()))
                per_dev = gib(each[0]) if len(each) == 1 else f"{gib(each[0])} to {gib(each[-1])}"
                lines.append(f"    {x}: {per_dev} per device on devices {sorted(mine)}")
        pending = f" + {gib(planned)} planned and not yet allocated" if planned else ""
        return DeviceMemoryError(
            f"{what}: not enough memory on {pool.name} (devices {list(pool.devices)}): the new tensors need "
            f"{gib(need)}{pending}, {gib(free)} is free and {self.margin:.0%} of it is kept back "
            f"(DTORCH_MEMORY_MARGIN).\n"
            + "\n".join(lines)
            + "\nNothing was sent; the mesh and every other tensor "
            "are still usable. Fix: shard the tensor over more devices (Shard instead of Replicate), use a smaller "
            "shape or dtype, or free tensors first; DTORCH_MEMORY_CHECK=0 turns this check off.",
            op=what,
            need_bytes=need,
            free_bytes=free,
            pool=pool.name,
        )


def memory_guard_for(
    runner: Any,
    *,
    idle: Callable[[], bool] | None = None,
    settle: Callable[[], None] | None = None,
    catch_up: Callable[[], None] | None = None,
) -> MemoryGuard | None:
    """The guard of ``runner``'s devices (``None`` when the check is off or the runner is unknown)."""
    if not check_enabled():
        return None
    pools_fn = getattr(runner, "memory_pools", None)
    if callable(pools_fn):
        pools = list(pools_fn())
    else:
        devices = tuple(getattr(runner, "devices", ()))
        device_type = getattr(runner, "device_type", "cpu")
        torch_devices = getattr(runner, "torch_devices", None)
        if not devices:
            return None
        if device_type == "cpu" or torch_devices is None:
            pools = [MemoryPool("host RAM", devices, host_available_bytes)]
        else:
            by_gpu: dict[int, list[int]] = {}
            for d in devices:
                by_gpu.setdefault(int(torch_devices[d].index or 0), []).append(d)
            pools = [
                MemoryPool(f"cuda:{i}", tuple(ds), pool_free_of_cuda(i)) for i, ds in sorted(by_gpu.items())
            ]
    progress = getattr(runner, "finished_batches", None)
    return MemoryGuard(
        pools, idle=idle, settle=settle, progress=progress if callable(progress) else None, catch_up=catch_up
    )
