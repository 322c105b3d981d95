"""``EagerGraphExecutor``: records ops as they are called and streams them, batched, to a runner's workers.

Every operator the :class:`~torch_dtorch.executor.constructor.GraphConstructor` adds becomes one instruction in a
pending batch (the graph keeps nothing: ``LogicalGraph(record=False)``). The batch goes to the runner

- when a value is requested (:meth:`EagerGraphExecutor.fetch`, :meth:`~EagerGraphExecutor.sync`),
- when it holds ``batch_size`` instructions (``DTORCH_BATCH_SIZE``), or
- after ``flush_interval_ms`` without a new op (``DTORCH_FLUSH_MS``; a daemon timer thread),

so ``call`` returns as soon as the operator is recorded and the workers run behind the controller. All methods are
thread-safe. Values come back as :class:`~torch_dtorch.executor.future.TensorFuture`, resolved in request order by
one resolver thread.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from torch_dtorch._compat import replay_views
from torch_dtorch.config import RedistributePolicy, get_config
from torch_dtorch.executor.constructor import REDISTRIBUTE, GraphConstructor
from torch_dtorch.executor.copy_views import CopyViews
from torch_dtorch.executor.eager_planned import PlannedRecorder, user_call_site
from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.executor.instructions import (
    Barrier,
    Fetch,
    Free,
    Instruction,
    Redistribute,
    RunOp,
    Upload,
)
from torch_dtorch.executor.memory_check import memory_guard_for
from torch_dtorch.executor.resolver import ValueRequest, ValueResolver
from torch_dtorch.executor.runner import Runner
from torch_dtorch.graph import LogicalGraph, Operand, Operator
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Placements, Replicate, local_shape_and_offset
from torch_dtorch.placement_rules.ranks import distribute

__all__ = ["EagerGraphExecutor"]

log = logging.getLogger(__name__)


#: ids merged into one Free instruction at most
_FREE_CHUNK = 1024


class EagerGraphExecutor:
    """Streams operators to ``runner`` in batches.

    Args:
        runner: a :class:`~torch_dtorch.executor.runner.Runner` (a ``ThreadRunner`` or a ``ClusterRunner``). The
            executor owns it: :meth:`shutdown` stops it.
        batch_size: instructions per batch (default ``DTORCH_BATCH_SIZE``).
        flush_interval_ms: flush pending work after this long without a new op (default ``DTORCH_FLUSH_MS``).
        default_mesh / policy: passed to the :class:`GraphConstructor`.
    """

    def __init__(
        self,
        runner: Runner,
        *,
        batch_size: int | None = None,
        flush_interval_ms: float | None = None,
        default_mesh: DeviceMesh | None = None,
        policy: RedistributePolicy | None = None,
    ) -> None:
        cfg = get_config()
        self.runner = runner
        #: where fetched values land (``None``: CPU); the device layer sets cuda:0 for CUDA meshes
        self.result_device: torch.device | None = None
        self.batch_size = int(batch_size if batch_size is not None else cfg.batch_size)
        if self.batch_size < 1:
            raise ValueError(f"EagerGraphExecutor: batch_size must be >= 1, got {batch_size}")
        interval = flush_interval_ms if flush_interval_ms is not None else cfg.flush_ms
        if interval < 0:
            raise ValueError(f"EagerGraphExecutor: flush_interval_ms must be >= 0, got {flush_interval_ms}")
        self.flush_interval = float(interval) / 1000.0
        self.constructor = GraphConstructor(
            LogicalGraph(record=False), default_mesh=default_mesh, policy=policy
        )
        self.constructor.listeners.append(self._on_operator)
        self._lock = threading.RLock()
        self._pending: list[Instruction] = []
        #: ids of operands whose last tensor died (:meth:`release`), freed before the next instruction
        self._dead: collections.deque[int] = collections.deque()
        #: drained dead operands the memory guard's ledger has not been told of yet (:meth:`release_to_ledger`)
        self._unledgered: list[int] = []
        #: views that read a redistributed copy of their input, refreshed after in-place writes to that input
        self.copy_views = CopyViews(self, self._dead)
        self._last = 0.0
        #: called (without the lock) before a flush or sync: the device layer's table queues the frees of dead
        #: tensors (the native table's storage deleters cannot call Python) and hands them over here
        self.collect: Callable[[], object] | None = None
        self._keys = itertools.count()
        self._closed = False
        self._wake = threading.Event()
        self.num_flushes = 0
        self._timer = threading.Thread(target=self._timer_loop, name="dtorch-flush-timer", daemon=True)
        self._timer.start()
        self._resolver = ValueResolver(self)
        self.constructor.memory = memory_guard_for(
            runner, idle=self._workers_idle, settle=self.sync, catch_up=self.release_to_ledger
        )
        #: the recording of planned calls (the fast path's hits, replays of known plans): its entry points are bound
        #: here as attributes, so a hit costs one call
        self.planned = PlannedRecorder(self)
        self.record_fast = self.planned.record_fast
        self.call_planned = self.planned.call_planned

    def _workers_idle(self) -> bool:
        """Whether the workers ran everything sent so far and nothing is pending (the memory check's planned bytes
        are allocated by then, so the free figure shows them)."""
        wait_idle = getattr(self.runner, "wait_idle", None)
        return not self._pending and wait_idle is not None and bool(wait_idle(0))

    # --- recording ----------------------------------------------------------------------------------------------
    @property
    def graph(self) -> LogicalGraph:
        return self.constructor.graph

    def input(
        self,
        shape: Sequence[int],
        mesh: DeviceMesh | None,
        placements: Sequence[Placement] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        tag: str | None = None,
    ) -> Operand:
        """A new input operand (give it data with :meth:`upload` or :meth:`upload_shards`)."""
        with self._lock:
            return self.constructor.input(shape, mesh, placements, dtype=dtype, tag=tag)

    def call(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        """Record ``op(*args, **kwargs)`` (see :meth:`GraphConstructor.call`); returns the output operand(s) at once."""
        with self._lock:
            self._check_open()
            c = self.constructor
            before = c.last_call
            out = c.call(op, *args, **kwargs)
            last = c.last_call
            if last is not None and last is not before:
                if last.moved:
                    self.planned.free_moved([last.inputs[i] for i in last.moved], last.outputs)
                if self.copy_views.records:  # a write refreshes the copy-views of its storage
                    self.copy_views.after_call(last.rule, last.outputs)
                if last.rule.view_of is not None:
                    replay_views()  # (autograd must replay dtorch views, not as_strided them)
            return out

    def redistribute(
        self,
        x: Operand,
        placements: Sequence[Placement],
        device_mesh: DeviceMesh | None = None,
        *,
        copy: bool = True,
    ) -> Operand:
        """Record ``x.redistribute(device_mesh, placements)``; returns the new operand at once (``copy=False``: a
        tensor of its own, see :meth:`GraphConstructor.redistribute`)."""
        with self._lock:
            self._check_open()
            return self.constructor.redistribute(x, placements, device_mesh=device_mesh, copy=copy)

    def append_instruction(self, instr: Instruction) -> None:
        """Queue an instruction of another layer (e.g. the compile backend's ``RunProgram``) in issue order."""
        with self._lock:
            self._check_open()
            self._append(instr)

    def append_with_outputs(
        self,
        specs: Sequence[tuple[tuple[int, ...], torch.dtype, DeviceMesh, Placements, tuple[int, ...] | None]],
        make: Callable[[list[Operand]], Any],
        *,
        flush: bool = False,
    ) -> list[Operand]:
        """New operands of known metadata (``(shape, dtype, mesh, placements, stride)`` each) and the instruction
        ``make(operands)`` that fills them, queued in issue order under one lock acquisition (the compile backend's
        ``RunProgram``: one call, one instruction). With ``flush`` the batch is sent at once: a whole compiled
        program should start on the workers now, not when later small ops fill the batch or the timer fires."""
        with self._lock:
            if self._closed:
                self._check_open()
            g = self.constructor.graph
            oid = g._next_operand
            outs = [Operand(oid + i, *spec) for i, spec in enumerate(specs)]
            g._next_operand = oid + len(outs)
            if g.record:
                for o in outs:
                    g.operands[o.id] = o
            self._append(make(outs))
            if flush:
                self._flush_locked()
            return outs

    def _on_operator(self, node: Operator) -> None:
        call_site = user_call_site() if get_config().debug else None
        instr: Instruction = (
            Redistribute(node, call_site)
            if type(node.op) is str and node.op == REDISTRIBUTE
            else RunOp(node, call_site)
        )
        self._append(instr)

    def _append(self, instr: Instruction) -> None:
        # callers hold self._lock
        pending = self._pending
        if self._dead:
            self._drain_dead()
        pending.append(instr)
        self._last = time.monotonic()
        if len(pending) >= self.batch_size:
            self._flush_locked()
        elif len(pending) == 1:
            self._wake.set()

    # --- data in ------------------------------------------------------------------------------------------------
    def upload(self, operand: Operand, value: torch.Tensor) -> None:
        """Give ``operand`` the global ``value``: split per its placements (a Partial axis puts the value on the
        group's first rank and zeros elsewhere), shards through the store, one ``Upload`` instruction."""
        root = _root(operand, "upload")
        if tuple(value.shape) != operand.shape or value.dtype != operand.dtype:
            raise ValueError(
                f"upload: {operand.describe()} needs a {operand.type_str()} tensor, got "
                f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            )
        shards = distribute(value.detach(), root.shape, operand.root_placements, gen=None)
        self._upload({d: shards[c] for d, c in root.coordinates()}, operand)

    def upload_scalar(self, value: torch.Tensor, mesh: DeviceMesh, devices: Sequence[int]) -> Operand:
        """A new Replicate 0-d operand on ``mesh`` (whose root has ``devices``) holding the plain 0-d tensor
        ``value`` (no grad: a per-call scalar of the fast path, freed by the caller after its op): one copy of
        ``value`` in every device's store entry (the workers only read it), one ``Upload``, no memory-guard
        accounting (a few bytes)."""
        v = value.clone()  # (the caller may write ``value`` before the workers read it)
        with self._lock:
            self._check_open()
            x = self.constructor.input((), mesh, [Replicate()] * mesh.ndim, dtype=v.dtype)
            key = next(self._keys)
            put = self.runner.store.put
            for d in devices:
                put((key, d), v)
            self._append(Upload(x, key))
        return x

    def upload_shards(self, operand: Operand, shards: Mapping[int, torch.Tensor]) -> None:
        """Give ``operand`` one local tensor per device of its mesh (``from_local``); shapes and dtype are checked."""
        root = _root(operand, "upload_shards")
        devices = root.devices
        missing = [d for d in devices if d not in shards]
        extra = [d for d in shards if d not in devices]
        if missing or extra:
            raise ValueError(
                f"upload_shards: {operand.describe()} needs one tensor for each device {devices}; "
                f"missing {missing}, unexpected {extra}"
            )
        rp = operand.root_placements
        for d, c in root.coordinates():
            want = tuple(local_shape_and_offset(operand.shape, root.shape, rp, c)[0])
            t = shards[d]
            if tuple(t.shape) != want or t.dtype != operand.dtype:
                raise ValueError(
                    f"upload_shards: device {d} (rank {c}) of {operand.describe()} needs "
                    f"{str(operand.dtype).removeprefix('torch.')}{list(want)}, got "
                    f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                )
        self._upload({d: shards[d].detach().clone() for d in devices}, operand)  # the store owns its tensors

    def _upload(self, per_device: Mapping[int, torch.Tensor], operand: Operand) -> None:
        with self._lock:
            self._check_open()
            guard = self.constructor.memory
            if guard is not None:
                per = {d: t.numel() * t.element_size() for d, t in per_device.items()}
                guard.check("upload", [(operand.describe(), per)])
                guard.track(operand.id, per)
            key = next(self._keys)
            store = self.runner.store
            for d, t in per_device.items():
                store.put((key, d), t)
            self._append(Upload(operand, key))

    # --- data out -----------------------------------------------------------------------------------------------
    def fetch(self, operand: Operand) -> TensorFuture:
        """Flush and return a future of ``operand``'s global value. Only the devices needed travel: every rank of a
        Partial axis, one replica per shard otherwise."""
        root = _root(operand, "fetch")
        rp = operand.root_placements
        device_at = {c: d for d, c in root.coordinates()}
        keep = [not isinstance(p, Replicate) for p in rp]  # Shard and Partial ranks all count
        rep = {c: tuple(i if k else 0 for i, k in zip(c, keep)) for c in device_at}
        devices = tuple(sorted({device_at[r] for r in rep.values()}))
        fut = TensorFuture(operand.name)
        with self._lock:
            self._check_open()
            key = next(self._keys)
            self._pending.append(Fetch(operand, key, devices))
            self._flush_locked()
            self._resolver.put(
                ValueRequest(fut, key, devices, {c: device_at[r] for c, r in rep.items()}, root.shape, rp)
            )
        return fut

    def fetch_local(self, operand: Operand, device: int) -> TensorFuture:
        """Flush and return a future of the shard ``device`` holds (``to_local``), as a CPU copy."""
        root = _root(operand, "fetch_local")
        if device not in root.devices:
            raise ValueError(f"fetch_local: device {device} is not in the mesh of {operand.describe()}")
        fut = TensorFuture(f"{operand.name} on device {device}")
        with self._lock:
            self._check_open()
            key = next(self._keys)
            self._pending.append(Fetch(operand, key, (device,)))
            self._flush_locked()
            self._resolver.put(ValueRequest(fut, key, (device,), {}, (), (), local=device))
        return fut

    def release(self, operand_id: int) -> None:
        """Free an operand whose last tensor died (called from the tensor table's weakref callback, on any thread):
        lock-free, the id joins a ``Free`` in front of the next instruction (or the next flush). The source of a
        live copy-view stays until that view dies (:mod:`.copy_views`)."""
        cv = self.copy_views
        if cv.records and cv.on_release(operand_id):
            return
        dead = self._dead
        dead.append(operand_id)
        if len(dead) == 1 and not self._pending:
            self._last = time.monotonic()
            self._wake.set()  # nothing else queued: the timer flushes the frees

    def _drain_dead(self) -> None:
        # callers hold self._lock; releases only append, so popping until empty never loses one
        dead = self._dead
        pending = self._pending
        last = pending[-1] if pending else None
        if type(last) is Free and len(last.operand_ids) < _FREE_CHUNK:  # type: ignore[union-attr]
            ids = last.operand_ids  # type: ignore[union-attr]
        else:
            ids = []
            pending.append(Free(ids))
        take = dead.popleft
        unledgered = self._unledgered
        while dead:
            i = take()
            ids.append(i)
            unledgered.append(i)

    def release_to_ledger(self) -> None:
        """Tell the memory guard which operands died since the last call. Their ``Free``s go out with the next
        instruction; the guard's ledger learns of them at each flush, and when the guard asks (its ``catch_up``:
        before it reads a fresh figure or settles), once per batch instead of once per op."""
        with self._lock:
            if self._dead:
                self._drain_dead()
            ids = self._unledgered
            if ids:
                self._unledgered = []
                guard = self.constructor.memory
                if guard is not None:
                    guard.released(ids)

    def free(self, operand: int | Operand) -> None:
        """Drop an operand's blobs on every worker, in order with the operators (consecutive frees share one
        ``Free``), so memory is released as soon as the last reader ran."""
        oid = operand.id if isinstance(operand, Operand) else int(operand)
        with self._lock:
            if self._closed:
                return  # freeing after shutdown (e.g. from a finalizer) is a no-op
            pending = self._pending
            if pending:
                last = pending[-1]
                if type(last) is Free and len(last.operand_ids) < _FREE_CHUNK:  # type: ignore[union-attr]
                    last.operand_ids.append(oid)  # type: ignore[union-attr]
                    return
            self._append(Free([oid]))

    # --- synchronization ----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Send the pending instructions to the workers now."""
        if self.collect is not None:
            self.collect()
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        self.release_to_ledger()
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        self.num_flushes += 1
        self.runner.submit(batch)
        guard = self.constructor.memory
        if guard is not None:
            guard.flushed(getattr(self.runner, "batches", 0))

    def sync(self, timeout: float | None = None) -> None:
        """Flush and wait until every worker has run everything issued so far (a barrier round trip)."""
        if self.collect is not None:
            self.collect()
        with self._lock:
            self._check_open()
            if self._dead:
                self._drain_dead()  # frees of operands already dead are part of "everything issued so far"
            key = next(self._keys)
            self._pending.append(Barrier(key))
            self._flush_locked()
        deadline = None if timeout is None else time.monotonic() + timeout
        for d in self.runner.devices:
            self._resolver.store_take((key, d), deadline)

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the timer and the resolver, drop pending work and shut the runner down. Idempotent; futures still
        pending fail with an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pending = []
            self._dead.clear()
        self._wake.set()
        try:
            self.runner.shutdown()
        finally:
            self._resolver.close()
            self._timer.join(5.0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> EagerGraphExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("EagerGraphExecutor: used after shutdown()")

    # --- threads ------------------------------------------------------------------------------------------------
    def _timer_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            while not self._closed:
                with self._lock:
                    if not self._pending and not self._dead:
                        break
                    due = self._last + self.flush_interval - time.monotonic()
                    if due <= 0:
                        self._flush_locked()
                        break
                time.sleep(due)

    def __repr__(self) -> str:
        return (
            f"EagerGraphExecutor({self.runner!r}, batch_size={self.batch_size}, pending={len(self._pending)})"
        )


def _root(operand: Operand, what: str) -> DeviceMesh:
    if operand.mesh is None:
        raise ValueError(f"{what}: {operand.describe()} is not bound to a mesh; use it with a mesh first")
    return operand.mesh.root
