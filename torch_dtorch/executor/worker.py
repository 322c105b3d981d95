"""``Worker``: the state of one device — its blobs — and the interpreter of the instructions sent to it.

A worker runs on its :class:`~torch_dtorch.runtime.stream.KernelStream` thread (thread mode) or as its own process
(process mode: :mod:`~torch_dtorch.cluster.worker.process`). It receives every batch and skips the instructions that do not concern its device.
Kernel errors are sticky per operand (see :mod:`torch_dtorch.runtime.op_runner`); unrelated operands keep working.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch.config import get_config
from torch_dtorch.executor.fast import replay_key
from torch_dtorch.executor.instructions import (
    Barrier,
    FastRun,
    Fetch,
    Free,
    Instruction,
    Redistribute,
    RunOp,
    Upload,
)
from torch_dtorch.executor.worker_io import WorkerTransfers
from torch_dtorch.graph import Operand
from torch_dtorch.placement_rules import OpCall
from torch_dtorch.runtime.blob import Blob
from torch_dtorch.runtime.native_replay import NativeChain
from torch_dtorch.runtime.native_replay import extension as native_extension
from torch_dtorch.runtime.native_replay import release as release_handles
from torch_dtorch.runtime.op_runner import OpRunner, kernel_hooks
from torch_dtorch.runtime.replay import AMBIGUOUS, LocalCall, resolve
from torch_dtorch.runtime.sticky import PoisonBoard
from torch_dtorch.runtime.stream import KernelStream

__all__ = ["Worker", "declare_worker_module", "register_instruction", "worker_modules"]

log = logging.getLogger(__name__)

_UNRESOLVED: Any = object()
_NOWHERE: tuple[tuple[()], int] = ((), -1)  # Worker._at outside run_batch
#: resolved local calls a worker keeps (plans and decoded templates are bounded by their own caches; this bounds
#: the worst case)
_MAX_RESOLVED = 16384

#: the handler of every instruction type, ``type -> handler(worker, instr)``: the built-in ones (methods of
#: :class:`Worker`) and those defined elsewhere (e.g. the compile backend's program replay); filled by
#: :func:`register_instruction` at import
_HANDLERS: dict[type, Callable[[Worker, Any], None]] = {}


#: modules a worker process imports before its first instruction, beyond this one: those that define instructions
#: and their handlers above this layer (the compile backend's programs). Declared by the modules themselves at import
#: on the controller, and sent to each worker process in its welcome, so that nothing here names a higher layer.
_WORKER_MODULES: list[str] = []


def declare_worker_module(name: str) -> None:
    """Have every worker process import ``name`` (a module that registers instructions) when it joins."""
    if name not in _WORKER_MODULES:
        _WORKER_MODULES.append(name)


def worker_modules() -> tuple[str, ...]:
    """The modules declared with :func:`declare_worker_module`, in declaration order."""
    return tuple(_WORKER_MODULES)


def register_instruction(
    cls: type,
) -> Callable[[Callable[[Worker, Any], None]], Callable[[Worker, Any], None]]:
    """Decorator: ``handler(worker, instr)`` runs every ``cls`` instruction on every worker (the handler decides
    whether it concerns ``worker.device``; it must not raise: failures become sticky operand errors)."""

    def deco(fn: Callable[[Worker, Any], None]) -> Callable[[Worker, Any], None]:
        if cls in _HANDLERS:
            raise ValueError(f"register_instruction: {cls.__name__} already has a handler")
        _HANDLERS[cls] = fn
        return fn

    return deco


class Worker(WorkerTransfers):
    """Holds the blobs of one device and executes instructions for it.

    Args:
        device: device id (the worker's rank in every mesh).
        torch_device: where its tensors live (``cpu``, ``cuda:i``).
        comm: its communicator (e.g. ``collectives.memory.InMemoryComm``).
        store: the TensorStore shared with the controller (uploads in, fetches and barrier markers out).
        stream: its :class:`KernelStream` (CUDA streams/events); ``None`` runs everything on the caller's thread.
        board: shared :class:`PoisonBoard` of the runner (thread mode).
        validate: check kernel outputs (default: ``DTORCH_VALIDATE_KERNEL_IO``).
    """

    def __init__(
        self,
        device: int,
        torch_device: torch.device | str,
        comm: Any,
        store: Any,
        *,
        stream: KernelStream | None = None,
        board: PoisonBoard | None = None,
        validate: bool | None = None,
    ) -> None:
        self.device = device
        self.torch_device = torch.device(torch_device)
        self.comm = comm
        self.store = store
        self.stream = stream
        self.blobs: dict[int, Blob] = {}
        cfg = get_config()
        self.op_runner = OpRunner(
            device,
            self.torch_device,
            self.blobs,
            stream,
            comm,
            validate=cfg.validate_kernel_io if validate is None else validate,
            board=board,
        )
        self._debug = cfg.debug
        #: resolved fast-path plans (``None``: the general path); plans live as long as the fast path's cache
        self._resolved: dict[Any, LocalCall | None] = {}
        self._replay_on = cfg.worker_replay
        #: runs of replayed ops for the native loop (``None``: no extension, or replay off)
        self._chain: NativeChain | None = None
        if self._replay_on and native_extension() is not None:
            self._chain = NativeChain(device, self.blobs, stream)
        self.executed = 0  # instructions that concerned this device (for tests and stats)
        self.replayed = 0  # of which fast-path hits replayed through their resolved local call
        #: ops run on the general local path (``OpRunner.run_op``), per operator name (for tests and benchmarks:
        #: what the replay does not cover yet)
        self.general: Counter[str] = Counter()
        #: the running batch and the index of the instruction executing on the general path (:meth:`freed_after`)
        self._at: tuple[Sequence[Instruction], int] = _NOWHERE

    # --- entry points -------------------------------------------------------------------------------------------
    def run_batch(
        self,
        batch: Sequence[Instruction],
        *,
        before: Callable[[int, Instruction], None] | None = None,
    ) -> None:
        """Execute a batch in order. Consecutive replayable ops run together in the native loop (GIL released);
        anything else first flushes them. ``before(i, instruction)`` is called as each instruction is taken (the
        process worker's heartbeat notes it)."""
        chain = self._chain
        if chain is None:
            try:
                for i, instr in enumerate(batch):
                    if before is not None:
                        before(i, instr)
                    self._at = (batch, i)
                    self.execute(instr)
            finally:
                self._at = _NOWHERE
            return
        # the hot lane: consecutive fast-path hits whose plans this worker resolved to native calls go onto the
        # chain in C++ (``NativeChain.queue_runs``: the checks of ``_replay_call``, made once per plan and batch);
        # what it stops at takes the Python path below (``_replay`` resolves a plan met for the first time)
        resolved = (
            self._resolved if self._replay_on and not self.op_runner.validate and not kernel_hooks() else {}
        )
        lane = before is None
        checked: set[Any] = set()
        device = self.device
        n = len(batch)
        i = 0
        try:
            while i < n:
                instr = batch[i]
                t = type(instr)
                if t is FastRun and lane and resolved:
                    j, queued = chain.queue_runs(
                        batch,
                        i,
                        resolved=resolved,
                        checked=checked,
                        replayable=self._replayable,
                        key_of=replay_key,
                        fastrun=FastRun,
                        free=Free,
                        unresolved=_UNRESOLVED,
                        device=device,
                    )
                    self.executed += queued
                    self.replayed += queued
                    if j > i:
                        i = j
                        continue
                if before is not None:
                    before(i, instr)
                i += 1
                if t is FastRun:
                    if self._replay(instr, chain):  # type: ignore[arg-type]
                        continue
                elif t is RunOp:
                    if self._replay_op(instr, chain):  # type: ignore[arg-type]
                        continue
                elif t is Free and len(chain):
                    chain.free(instr.operand_ids)  # type: ignore[union-attr]
                    continue
                elif t is Upload:  # a new operand the chain neither makes nor reads yet: no need to flush it
                    self.execute(instr)
                    continue
                if len(chain):
                    chain.flush()
                self._at = (batch, i - 1)
                self.execute(instr)
        finally:
            self._at = _NOWHERE
            if len(chain):
                chain.flush()

    def freed_after(self, instr: object) -> list[int]:
        """The operand ids that the ``Free`` instructions right after ``instr`` in the running batch drop (none
        unless ``instr`` is the instruction :meth:`run_batch` is executing): its handler may drop their blobs early,
        since nothing in between reads them. An instruction of another layer that starts with frees says which with
        ``leading_frees() -> (ids, nothing else)`` (process mode's hit-record runs)."""
        batch, i = self._at
        if i < 0 or batch[i] is not instr:
            return []
        ids: list[int] = []
        for later in batch[i + 1 :]:
            if type(later) is Free:
                ids.extend(later.operand_ids)  # type: ignore[attr-defined]
                continue
            leading = getattr(later, "leading_frees", None)
            if leading is None:
                break
            more, only = leading()
            ids.extend(more)
            if not only:
                break
        return ids

    @staticmethod
    def _replayable(plan: Any, checked: set[Any]) -> bool:
        """The plan's rule still runs the op as is (not patched at run time: tests, tools); noted in ``checked``."""
        rule = plan.rule
        if not rule.may_run_op_as_is(plan.op) or "localize" in vars(rule):
            return False
        checked.add(plan)
        return True

    def execute(self, instr: Instruction) -> None:
        """Execute one instruction if it concerns this device (never raises: failures become sticky errors). One
        table lookup: :data:`_HANDLERS` holds the handler of every instruction type, these of this class included."""
        handler = _HANDLERS.get(type(instr))
        if handler is None:
            log.error("worker %d: unknown instruction %r", self.device, instr)
            return
        handler(self, instr)

    # --- the handlers of the built-in instructions (registered below the class) ---------------------------------
    def _on_run_op(self, instr: RunOp) -> None:
        if self._replay_op(instr):
            return
        node = instr.node
        if node.assign is None or self.device not in node.assign.devices:
            return
        self.executed += 1
        self.general[node.name] += 1
        self.op_runner.run_op(node, instr=instr, call_site=self._call_site(instr))

    def _on_redistribute(self, instr: Redistribute) -> None:
        node = instr.node
        if node.assign is None or self.device not in node.assign.devices:
            return
        self.executed += 1
        self.op_runner.run_redistribute(node, instr=instr, call_site=self._call_site(instr))

    def _on_fast_run(self, instr: FastRun) -> None:
        if not self._replay(instr):
            for part in instr.expand():
                self.execute(part)

    def _on_free(self, instr: Free) -> None:
        pop = self.blobs.pop
        for i in instr.operand_ids:
            pop(i, None)

    def _on_upload(self, instr: Upload) -> None:
        if self.op_runner.holds(instr.operand):
            self.executed += 1
            self._upload(instr)

    def _on_fetch(self, instr: Fetch) -> None:
        if self.device in instr.devices:
            self.executed += 1
            self._fetch(instr)

    def _on_barrier(self, instr: Barrier) -> None:
        self._barrier(instr)

    # --- for handlers of instructions that carry runs of fast-path ops (process mode's hit records) --------------
    def replay_chain(self) -> NativeChain | None:
        """The native chain when resolved calls may be queued on it now (replay on, no validation, no kernel
        hooks), else ``None``."""
        chain = self._chain
        if chain is None or not self._replay_on or self.op_runner.validate or kernel_hooks():
            return None
        return chain

    def resolved_calls(self) -> dict[Any, LocalCall | None]:
        """Every resolved local call by replay key (read by the native lanes; ``None``: the general path's)."""
        return self._resolved

    def run_one(self, instr: Instruction, chain: NativeChain | None) -> None:
        """Run one instruction as :meth:`run_batch` does (queued on ``chain`` when it replays, after flushing it
        otherwise)."""
        if chain is not None:
            if type(instr) is RunOp and self._replay_op(instr, chain):
                return
            if len(chain):
                chain.flush()
        self.execute(instr)

    def forget_resolved(self) -> None:
        """Drop every resolved call (their native handles go back to the native loop)."""
        release_handles([c.native for c in self._resolved.values() if c is not None and c.native >= 0])
        self._resolved.clear()

    # --- handlers -----------------------------------------------------------------------------------------------
    def _replay(self, run: FastRun, chain: NativeChain | None = None) -> bool:
        """Run a fast-path hit through its resolved :class:`~torch_dtorch.runtime.replay.LocalCall` (resolved on the
        first hit of its plan); ``False``: the general path must run it (moved inputs, a rule with its own local
        kernel, a missing or poisoned input, hooks or validation on)."""
        plan = run.plan
        if plan.nmoves:
            return False
        key = replay_key(run)
        if key is None:
            return False
        return self._replay_call(
            key,
            plan.rule,
            plan.op,
            lambda: plan.call(run.args if run.args is not None else plan.args_of(run.inputs), run.inputs),
            run.inputs,
            run.outputs,
            plan.assign.devices,
            run.call_site,
            chain,
        )

    def _replay_op(self, instr: RunOp, chain: NativeChain | None = None) -> bool:
        """Like :meth:`_replay` for a ``RunOp`` that carries a ``replay_key`` (a fast-path plan's op after its moved
        inputs, a decoded template in process mode)."""
        if instr.replay_key is None:
            return False
        node = instr.node
        return self._replay_call(
            instr.replay_key,
            node.payload.rule,
            node.op,
            lambda: node.payload.call,
            node.inputs,
            node.outputs,
            node.assign.devices if node.assign is not None else (),
            instr.call_site,
            chain,
        )

    def _replay_call(
        self,
        key: Any,
        rule: Any,
        op: Any,
        call_of: Callable[[], OpCall],
        inputs: list[Operand | None],
        outputs: list[Operand],
        devices: tuple[int, ...],
        call_site: str | None,
        chain: NativeChain | None,
    ) -> bool:
        """Replay one op through its resolved local call: queued on ``chain`` (the native loop) when it has a native
        handle, else in Python (after the chain ran). ``False``: the general path must run it."""
        if not self._replay_on or self.op_runner.validate or kernel_hooks():
            return False
        if self.device not in devices:
            return True
        # (a rule patched at run time — tests, tools — takes the general path)
        if not rule.may_run_op_as_is(op) or "localize" in vars(rule):
            return False
        local_call = self._resolved.get(key, _UNRESOLVED)
        if local_call is None:
            return False
        if chain is not None:
            if local_call is not _UNRESOLVED and local_call.native >= 0:
                # the inputs the chain makes are no blobs yet: the chain takes them; a missing or poisoned blob
                # refuses the op (the general path makes or passes on the sticky error)
                return self._chained(local_call, op, inputs, outputs, call_site, chain)
            if len(chain):
                chain.flush()  # resolving and the Python replay read the blobs the chain makes
        blobs = self.blobs
        ins: list[Blob | None] = []
        for x in inputs:
            if x is None:
                ins.append(None)
                continue
            b = blobs.get(x.id)
            if b is None or b.error is not None:
                return False  # the general path makes (or passes on) the sticky error
            ins.append(b)
        if local_call is _UNRESOLVED:
            call = call_of()
            ctx = self.op_runner.local_context(
                call, outputs, [b.tensor if b is not None else None for b in ins]
            )
            local_call = resolve(rule, call, ctx, native=self._chain is not None)
            if local_call is AMBIGUOUS:
                return False
            if len(self._resolved) >= _MAX_RESOLVED:
                self.forget_resolved()  # keys are plans and decoded templates; a long run may make many
            self._resolved[key] = local_call
            if local_call is None:
                return False
            if chain is not None and local_call.native >= 0:
                return self._chained(local_call, op, inputs, outputs, call_site, chain)
        self.executed += 1
        self.replayed += 1
        self.op_runner.run_resolved(local_call, ins, outputs, op=op, call_site=call_site)
        return True

    def _chained(
        self,
        local_call: LocalCall,
        op: Any,
        inputs: list[Operand | None],
        outputs: list[Operand],
        call_site: str | None,
        chain: NativeChain,
    ) -> bool:
        """Queue a resolved op with a native handle on ``chain``; ``False``: an input the chain cannot take."""
        if not chain.add(
            local_call.native, op, [x.id for x in inputs if x is not None], [o.id for o in outputs], call_site
        ):
            return False
        self.executed += 1
        self.replayed += 1
        return True

    def _call_site(self, instr: RunOp | Redistribute) -> str | None:
        if instr.call_site is not None:
            return instr.call_site
        if self._debug:
            return getattr(instr.node, "call_site", None)
        return None

    def __repr__(self) -> str:
        return f"Worker({self.device}, {self.torch_device}, {len(self.blobs)} blobs)"


for _cls, _handler in (
    (RunOp, Worker._on_run_op),
    (Redistribute, Worker._on_redistribute),
    (FastRun, Worker._on_fast_run),
    (Free, Worker._on_free),
    (Upload, Worker._on_upload),
    (Fetch, Worker._on_fetch),
    (Barrier, Worker._on_barrier),
):
    register_instruction(_cls)(_handler)
