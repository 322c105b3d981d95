"""Worker side of compiled graphs: three instruction types and their handlers.

- :class:`LoadProgram` — sent once per compiled variant: every worker keeps its own :class:`LocalProgram`.
- :class:`RunProgram` — one per call: input operand ids in, output operand ids out (the controller has already
  made the output tensors; the workers fill their blobs).
- :class:`UnloadProgram` — the compiled variant died on the controller.

Errors are sticky like eager kernels: a poisoned input or a failing segment poisons every output of the call; the
rank keeps taking part in the program's collectives with zeros of the right local shape (so peers never hang), and
posts the error on the runner's poison board so that ranks that received its data poison their outputs too.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_dtorch.backend.local import (
    CollectiveStep,
    KernelStep,
    LocalMeta,
    LocalProgram,
    ProgramSource,
    Segment,
    SlotRef,
    build_local_program,
)
from torch_dtorch.backend.segment_compile import boxed as _boxed
from torch_dtorch.backend.segment_compile import compile_segment as _compile_segment
from torch_dtorch.executor.worker import Worker, register_instruction
from torch_dtorch.runtime import op_runner
from torch_dtorch.runtime.blob import Blob, KernelError
from torch_dtorch.runtime.sticky import StickyCall, call_hooks, kernel_error
from torch_dtorch.runtime.stream import COMPUTE

__all__ = [
    "LoadProgram",
    "ProgramStats",
    "RunProgram",
    "UnloadProgram",
    "install_program",
    "loaded_program",
    "program_stats",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadProgram:
    """Each worker keeps its local program under ``program_id``: the one prebuilt for it in ``programs`` (thread
    mode), else the one it builds from ``source`` (process mode: the propagated operators travel through the codec
    and each worker localizes them for its own device)."""

    program_id: int
    programs: dict[int, LocalProgram]
    worker_compiler: str = "eager"
    cudagraphs: bool = False
    source: ProgramSource | None = None
    #: program inputs that hold the same tensors at every call (parameters, buffers, graph constants): inductor
    #: treats them as static, as plain ``torch.compile`` does a module's parameters
    static_inputs: tuple[int, ...] = ()


@dataclass(slots=True)  # not frozen: one is made per call, and a frozen __init__ costs ~3x more
class RunProgram:
    """Run program ``program_id`` on the blobs ``in_ids``; store its outputs as blobs ``out_ids``."""

    program_id: int
    in_ids: tuple[int, ...]
    out_ids: tuple[int, ...]
    call_site: str | None = None
    #: a program of a graph with symbolic sizes: this call's value of each SymInt input (``in_ids`` holds a
    #: placeholder id there)
    sym_values: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class UnloadProgram:
    program_id: int


@dataclass
class ProgramStats:
    """Replay statistics of one loaded program on one worker (the overhead benchmark reads them): calls and the
    worker thread's CPU seconds spent in them."""

    calls: int = 0
    seconds: float = 0.0


class _Loaded:
    __slots__ = ("program", "fns", "compiler", "cudagraphs", "stats", "name", "static")

    def __init__(
        self, program: LocalProgram, compiler: str, cudagraphs: bool, name: str, static: Sequence[int] = ()
    ) -> None:
        self.program = program
        #: each compute segment's function (boxed: one list of inputs, which it empties), made at its first call
        self.fns: list[Callable[[list[Any]], Any] | None] = [
            _boxed(s.gm.forward) if isinstance(s, Segment) and compiler == "eager" else None
            for s in program.steps
        ]
        self.compiler = compiler
        self.cudagraphs = cudagraphs
        self.stats = ProgramStats()
        self.name = name
        self.static = frozenset(static)


class _Failed:
    """A program this worker could not build: every call poisons all its outputs."""

    __slots__ = ("error",)

    def __init__(self, error: KernelError) -> None:
        self.error = error


_PROGRAMS: weakref.WeakKeyDictionary[Worker, dict[int, _Loaded | _Failed]] = weakref.WeakKeyDictionary()


def _table(worker: Worker) -> dict[int, _Loaded | _Failed]:
    table = _PROGRAMS.get(worker)
    if table is None:
        table = _PROGRAMS[worker] = {}
    return table


def loaded_program(worker: Worker, program_id: int) -> LocalProgram | None:
    hit = _PROGRAMS.get(worker, {}).get(program_id)
    return hit.program if type(hit) is _Loaded else None


def program_stats(worker: Worker, program_id: int) -> ProgramStats | None:
    hit = _PROGRAMS.get(worker, {}).get(program_id)
    return hit.stats if type(hit) is _Loaded else None


def install_program(
    worker: Worker,
    program_id: int,
    program: LocalProgram | BaseException,
    compiler: str,
    name: str,
    static: Sequence[int] = (),
) -> None:
    """Keep ``program`` (or the error that building it raised: every call then fails) under ``program_id``."""
    if isinstance(program, BaseException):
        err = KernelError(name, worker.device, program, detail="while building this rank's local program")
        err.__cause__ = program
        _table(worker)[program_id] = _Failed(err)
        return
    _table(worker)[program_id] = _Loaded(program, compiler, False, name, static)


@register_instruction(LoadProgram)
def _load(worker: Worker, instr: LoadProgram) -> None:
    name = f"compiled program {instr.program_id}"
    program = instr.programs.get(worker.device)
    if program is None:
        src = instr.source
        if src is None or worker.device not in src.devices:
            return  # not a device of this program
        try:
            program = build_local_program(src, worker.device, worker.torch_device)
        except Exception as e:  # noqa: BLE001 - handlers never raise: every call of the program fails instead
            log.exception("worker %d: building the local program of %s failed", worker.device, name)
            err = KernelError(name, worker.device, e, detail="while building this rank's local program")
            err.__cause__ = e
            _table(worker)[instr.program_id] = _Failed(err)
            return
    _table(worker)[instr.program_id] = _Loaded(
        program, instr.worker_compiler, instr.cudagraphs, name, instr.static_inputs
    )


@register_instruction(UnloadProgram)
def _unload(worker: Worker, instr: UnloadProgram) -> None:
    _table(worker).pop(instr.program_id, None)


def _zeros(meta: LocalMeta | None, device: torch.device) -> torch.Tensor | None:
    if meta is None:
        return None
    return torch.zeros(meta[0], dtype=meta[1], device=device)


def _host_synced(worker: Worker, run: Callable[[], Any]) -> Any:
    """``run()``, a collective or communicating kernel of the program, on the program's (compute) stream. With a
    stream-ordered communicator (``torch.distributed``: process mode) nothing more is needed; thread mode's in-memory
    collectives compute results on whichever rank's thread arrives last, so — as eager redistributes do
    (``OpRunner.host_sync_collectives``) — this rank's writes are complete before peers read them, and the device is
    synchronized after (a result may come from a peer thread's stream)."""
    if worker.torch_device.type != "cuda" or not worker.op_runner.host_sync_collectives:
        return run()
    torch.cuda.current_stream(worker.torch_device).synchronize()
    out = run()
    torch.cuda.synchronize(worker.torch_device)
    return out


def _collective(worker: Worker, step: CollectiveStep, x: torch.Tensor | None) -> torch.Tensor | None:
    execute_plan = worker.op_runner.execute_plan
    return _host_synced(worker, lambda: execute_plan(step.plan, x, device=worker.device, comm=worker.comm))


def _zeros_like_meta(meta: Any, device: torch.device) -> Any:
    """Zeros for a step's output meta: one ``LocalMeta`` or a tuple of them (ops returning several tensors)."""
    if meta is None or (len(meta) == 2 and isinstance(meta[1], torch.dtype)):
        return _zeros(meta, device)
    return tuple(_zeros(m, device) for m in meta)


def _resolve(value: Any, vals: list[Any]) -> Any:
    if type(value) is SlotRef:
        return vals[value.slot]
    if isinstance(value, (list, tuple)):
        items = [_resolve(v, vals) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _resolve(v, vals) for k, v in value.items()}
    return value


def _comm_kernel(worker: Worker, step: KernelStep, vals: list[Any], seq: int) -> Any:
    """A communicating rule kernel (context-parallel attention, norms over a sharded dim) with the worker's
    communicator; ``seq`` numbers this call of the step alike on every rank (its messages' tags)."""
    args, kwargs = _resolve(step.args, vals), _resolve(step.kwargs, vals)
    ctx = step.with_comm(worker.comm, seq)
    # as around collectives: peers read what this rank's stream wrote
    return _host_synced(worker, lambda: step.rule.kernel(step.call, ctx, args, kwargs))


@register_instruction(RunProgram)
def _run(worker: Worker, instr: RunProgram) -> None:
    loaded = _PROGRAMS.get(worker, {}).get(instr.program_id)
    if loaded is None:  # not a device of this program
        return
    if isinstance(loaded, _Failed):
        for oid in instr.out_ids:
            worker.blobs[oid] = Blob(error=loaded.error)
        return
    if op_runner.before_hooks:
        call_hooks(op_runner.before_hooks, instr, worker.device)
    stream = worker.stream
    if stream is not None and stream.is_cuda:
        with stream.use(COMPUTE):
            _execute(worker, loaded, instr)
    else:
        _execute(worker, loaded, instr)
    if op_runner.after_hooks:
        call_hooks(op_runner.after_hooks, instr, worker.device)


def _execute(worker: Worker, loaded: _Loaded, instr: RunProgram) -> None:
    t0 = time.thread_time()  # CPU time of this worker thread: GIL waits in thread mode do not count
    prog = loaded.program
    blobs = worker.blobs
    dev = worker.torch_device
    vals: list[Any] = [None] * prog.num_slots
    call = StickyCall(board=worker.op_runner.board, key=instr.out_ids[0] if instr.out_ids else None)
    in_blobs: list[Blob] = []
    for i, oid in enumerate(instr.in_ids):
        meta = prog.in_meta[i]
        if meta is None:
            continue
        b = blobs.get(oid)
        if b is None:
            call.fail(
                KernelError(
                    loaded.name,
                    worker.device,
                    f"input {i} (operand %{oid}) has no data on this worker (never uploaded or computed, or freed)",
                    call_site=instr.call_site,
                )
            )
            vals[i] = _zeros(meta, dev)
        elif b.error is not None:
            call.fail(b.error)
            vals[i] = _zeros(meta, dev)
        else:
            vals[i] = b.tensor
            in_blobs.append(b)
    b = None
    for i, v in zip(prog.sym_inputs, instr.sym_values):
        vals[i] = v
    stream = worker.stream
    if stream is not None and stream.is_cuda:
        stream.wait_for(in_blobs, COMPUTE)
    in_blobs.clear()
    # donation: the blobs the controller frees right after this call (the Free that follows it in the batch: a
    # backward's saved activations, a forward's dead inputs) go now, so that only ``vals`` holds them and each is
    # dropped after its last step — inside a compiled segment, after its last use there
    for oid in worker.freed_after(instr):
        blobs.pop(oid, None)
    key = call.key
    fns = loaded.fns
    for index, step in enumerate(prog.steps):
        if type(step) is Segment:
            outs: Any = None
            if call.error is None:
                args = [vals[s] for s in step.in_slots]
                for r in step.release:  # the segment holds its inputs now (and drops each after its last use)
                    vals[r] = None
                try:
                    fn = fns[index]
                    if fn is None:
                        fn = _compile_segment(loaded, index, step, args)
                    outs = fn(args)
                    if loaded.cudagraphs and dev.type == "cuda":
                        # a CUDA graph's outputs live in its memory pool; while one is still alive, CUDA graph
                        # trees record a new graph rather than replay over it. Blobs outlive the call, so they
                        # get their own copies (the first, compiling call's too) and the graph replays in place
                        outs = [o.clone() if isinstance(o, torch.Tensor) else o for o in outs]
                except Exception as e:  # noqa: BLE001 - becomes the outputs' sticky error
                    call.fail(kernel_error(e, op=loaded.name, device=worker.device, call_site=instr.call_site,
                                           detail=f"in compute segment {index}"))  # fmt: skip
            if call.error is not None:
                outs = [_zeros(m, dev) for m in step.out_meta]
            for s, v in zip(step.out_slots, outs):
                vals[s] = v
        else:  # a collective or a kernel that communicates: this rank takes part even after an error
            assert isinstance(step, (CollectiveStep, KernelStep))
            call.before_comm()  # receivers are ordered after the post
            kernel = type(step) is KernelStep
            try:  # on zeros after an error: the peers wait for this rank's messages
                if isinstance(step, KernelStep):
                    # the call's first output id is new every call and the same on every rank
                    seq = (key if key is not None else instr.program_id) * 64 + index % 64
                    y = _comm_kernel(worker, step, vals, seq)
                else:
                    y = _collective(worker, step, vals[step.in_slot] if step.in_slot is not None else None)
            except Exception as e:  # noqa: BLE001
                detail = f"in {step.note}" if kernel else f"plan: {step.note}"
                call.fail(
                    kernel_error(
                        e, op=loaded.name, device=worker.device, call_site=instr.call_site, detail=detail
                    )
                )
                y = _zeros_like_meta(step.out_meta, dev) if kernel else _zeros(step.out_meta, dev)
            vals[step.out_slot] = y
        for r in step.release:
            vals[r] = None
    if prog.num_collectives:
        call.after_comm()
    if call.error is None and worker.op_runner.validate and (bad := _validate(worker, loaded, prog, vals)):
        call.fail(bad)
    if call.poison(blobs, [oid for oid, slot in zip(instr.out_ids, prog.out_slots) if slot is not None]):
        _count(loaded, t0)
        return
    new: list[Blob] = []
    for oid, out_slot in zip(instr.out_ids, prog.out_slots):
        if out_slot is None:
            continue
        v = vals[out_slot]
        if v is None:
            blobs[oid] = Blob(
                error=KernelError(loaded.name, worker.device, f"output %{oid} was not produced")
            )
            continue
        b = Blob(v)
        new.append(b)
        blobs[oid] = b
    if stream is not None and new:
        stream.stamp(new, COMPUTE)
    _count(loaded, t0)


def _count(loaded: _Loaded, t0: float) -> None:
    stats = loaded.stats
    stats.calls += 1
    stats.seconds += time.thread_time() - t0


def _validate(worker: Worker, loaded: _Loaded, prog: LocalProgram, vals: list[Any]) -> KernelError | None:
    from torch_dtorch.runtime.op_runner import KernelIOError

    results: Any = prog.graph.output_node().args[0]
    for i, s in enumerate(prog.out_slots):
        if s is None:
            continue
        node = results[i]
        meta = node.meta.get("local") if isinstance(node, torch.fx.Node) else None
        v = vals[s]
        if meta is None or not isinstance(v, torch.Tensor):
            continue
        if tuple(v.shape) != tuple(meta[0]) or v.dtype != meta[1]:
            return KernelIOError(
                loaded.name,
                worker.device,
                f"output {i} is {v.dtype}{list(v.shape)}, the program expects {meta[1]}{list(meta[0])}",
            )
    return None


# --- process mode: instruction codecs -------------------------------------------------------------------------------


def _register_codecs() -> None:
    """Teach the batch codec (process mode) the program instructions. ``RunProgram`` / ``UnloadProgram`` are plain
    ids; a ``LoadProgram`` carries its :class:`ProgramSource` — the mesh, the boundary operands and every operator
    (``ctx.operator``: op, constants, placements, rule by qualified name; redistributes with their plans) — and
    each worker process builds its own local program from it. Worker processes import this module at start."""
    from torch_dtorch.cluster.codec.common import CodecError, register_codec

    def enc_run(instr: RunProgram, ctx: Any) -> Any:
        tree = [instr.program_id, list(instr.in_ids), list(instr.out_ids), instr.call_site]
        if instr.sym_values:
            tree.append(list(instr.sym_values))
        return tree

    def dec_run(tree: Any, ctx: Any) -> RunProgram:
        pid, ins, outs, site, *sym = tree
        run = RunProgram(int(pid), tuple(int(i) for i in ins), tuple(int(o) for o in outs), site)
        if sym:
            run.sym_values = tuple(int(v) for v in sym[0])
        return run

    def enc_unload(instr: UnloadProgram, ctx: Any) -> Any:
        return instr.program_id

    def dec_unload(tree: Any, ctx: Any) -> UnloadProgram:
        return UnloadProgram(int(tree))

    def enc_load(instr: LoadProgram, ctx: Any) -> Any:
        src = instr.source
        if src is None:
            raise CodecError(
                f"LoadProgram {instr.program_id}: no ProgramSource to ship to worker processes (only prebuilt "
                "thread-mode programs); build it with Propagated.source()"
            )
        # parts are visited in this order by dec_load: mesh, inputs, operators, outputs
        mesh = ctx.mesh(src.mesh)
        inputs = [ctx.operand(x) for x in src.inputs]
        operators = [ctx.operator(op) for op in src.operators]
        outputs = ctx.value(list(src.outputs))
        static = list(instr.static_inputs)
        return [
            instr.program_id,
            instr.worker_compiler,
            instr.cudagraphs,
            mesh,
            inputs,
            operators,
            outputs,
            static,
        ]

    def dec_load(tree: Any, ctx: Any) -> LoadProgram:
        pid, compiler, cudagraphs, mesh_tree, in_trees, op_trees, out_tree, static = tree
        mesh = ctx.mesh(mesh_tree)
        inputs = tuple(ctx.operand(t) for t in in_trees)
        operators = tuple(ctx.operator(t) for t in op_trees)
        outputs = tuple(ctx.value(out_tree))
        if mesh is None or any(x is None for x in inputs):
            raise CodecError(f"LoadProgram {pid}: malformed program (no mesh, or a missing input operand)")
        source = ProgramSource(mesh, inputs, operators, outputs)
        return LoadProgram(
            int(pid),
            {},
            worker_compiler=str(compiler),
            cudagraphs=bool(cudagraphs),
            source=source,
            static_inputs=tuple(int(i) for i in static),
        )

    register_codec(RunProgram, tag="compile.run", encode=enc_run, decode=dec_run)
    register_codec(UnloadProgram, tag="compile.unload", encode=enc_unload, decode=dec_unload)
    register_codec(LoadProgram, tag="compile.load", encode=enc_load, decode=dec_load)


try:
    _register_codecs()
except ImportError:  # pragma: no cover - a tree without the process-mode codec
    log.debug("no instruction codec: compiled programs are thread-mode only")
