"""Controller side of a compiled graph: the callable aot_autograd calls with the flat inputs on every call.

Dynamo guards on shapes, dtypes and devices but not on placements, so :class:`CompiledGraph` checks them on every
call: the input layouts (mesh and placements of each dtorch input) are the key of a cache of **variants**. A miss
propagates placements over the captured graph (:mod:`~torch_dtorch.backend.propagate`), builds one local program
per rank (:mod:`~torch_dtorch.backend.local`) and ships them to the workers once (:class:`LoadProgram`); every call
then makes the output tensors at once (their placements are known), appends one :class:`RunProgram` to the eager
executor's batch and returns — asynchronously, like eager ops.

Plain CPU/CUDA inputs (no dtorch tensor among them) compile for a 1-device mesh: its only local program is the
captured graph itself, run in the calling thread (bit-identical to eager torch; no worker round trip).
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from torch_dtorch import _compat
from torch_dtorch.backend.call_key import CallKeyMemo, fast_key
from torch_dtorch.backend.capture import format_aten_graph
from torch_dtorch.backend.local import LocalProgram, build_local_program
from torch_dtorch.backend.options import CompileOptions, check_cudagraph_devices
from torch_dtorch.backend.place_grad import GradPlacements, OutTarget
from torch_dtorch.backend.program import LoadProgram, RunProgram, UnloadProgram
from torch_dtorch.backend.propagate import InputSpec, Propagated, UnsupportedGraphError, propagate
from torch_dtorch.backend.report import CompileReport
from torch_dtorch.backend.symbolic import SymbolicVariant, plan_symbolic, run_symbolic, sym_positions
from torch_dtorch.device import binding
from torch_dtorch.device import state as _state
from torch_dtorch.device.dispatch import DeviceMismatchError, _free_callback, wrap
from torch_dtorch.device.fastpath import layout_of
from torch_dtorch.device.state import Session, get_session, session_or_none
from torch_dtorch.device.tensors import DEVICE_NAME, TABLE
from torch_dtorch.errors import DTorchError
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.ops.decompositions import inductor_decompositions_for
from torch_dtorch.placement import Replicate, placements_str

__all__ = ["CompiledGraph"]

log = logging.getLogger(__name__)

_PROGRAM_IDS = itertools.count(1)
_SCALAR_TAG = "scalar input"
_MAX_FAST_KEYS = 256


def _submit(executor: Any, instr: Any) -> None:
    """Append one instruction to the eager executor's pending batch (ordered with eager ops)."""
    executor.append_instruction(instr)


def _describe_key(operands: Sequence[Operand]) -> list[str]:
    return [f"in{i}: {x.describe().split(': ', 1)[1]}" for i, x in enumerate(operands)]


@dataclass
class _Variant:
    """One compiled layout of a graph: its programs on the workers and the recipe of its outputs."""

    program_id: int
    prop: Propagated
    programs: dict[int, LocalProgram]
    constants: list[torch.Tensor]  # dtorch tensors holding the uploaded graph constants (kept alive here)
    constant_ids: tuple[int, ...]
    outputs: list[Operand | Any]
    report: CompileReport
    finalizer: Any = field(default=None, repr=False)
    #: per call, precomputed: the output operands' ``(shape, dtype, mesh, placements, stride)`` and layout ids, and
    #: where each graph output comes from (``None``: the outputs are exactly the operands, in order)
    out_specs: tuple[tuple[Any, ...], ...] = ()
    out_layouts: tuple[int, ...] = ()
    recipe: tuple[tuple[bool, Any], ...] | None = None

    def __post_init__(self) -> None:
        ops = [o for o in self.outputs if isinstance(o, Operand)]
        self.out_specs = tuple((o.shape, o.dtype, o.mesh, o.placements, o.stride) for o in ops)
        self.out_layouts = tuple(layout_of(o) for o in ops)
        if len(ops) != len(self.outputs):
            self.recipe = tuple((isinstance(o, Operand), o) for o in self.outputs)


def _unload(generation: int, program_id: int) -> None:
    rt = session_or_none()
    if rt is None or rt.generation != generation or rt.executor.closed:
        return
    try:
        _submit(rt.executor, UnloadProgram(program_id))
    except Exception:  # noqa: BLE001 - best effort from a finalizer
        log.debug("unloading compiled program %d failed", program_id, exc_info=True)


class CompiledGraph:
    """What aot_autograd runs for the forward graph (boxed calling convention: one list of inputs)."""

    _boxed_call = True

    def __init__(
        self,
        gm: fx.GraphModule,
        fake_inputs: Sequence[Any],
        *,
        options: CompileOptions,
        backend: str,
        debug: bool = False,
        records: GradPlacements | None = None,
        grad_targets: GradPlacements | None = None,
        static_inputs: Sequence[int] = (),
    ) -> None:
        """``records`` (a training forward graph): told the variant of every call; ``grad_targets`` (its backward
        graph): asked where each output (a gradient) must end (:mod:`~torch_dtorch.backend.place_grad`);
        ``static_inputs``: the inputs that are the same tensors at every call (parameters and buffers, as aot_autograd
        marks them: :func:`~torch_dtorch._compat.static_input_indices`), which the workers' inductor treats as static
        like plain ``torch.compile`` does."""
        self.gm = gm
        self.static_inputs = tuple(static_inputs)
        self.records = records
        self.grad_targets = grad_targets
        self.options = options
        self.backend = backend
        self.debug = debug
        self.aten_text = format_aten_graph(gm)
        tensors = [x for x in fake_inputs if isinstance(x, torch.Tensor)]
        self.plain = not any(x.device.type == DEVICE_NAME for x in tensors)
        self.device_type = tensors[0].device.type if tensors and self.plain else "cpu"
        self.num_inputs = len(fake_inputs)
        results = gm.graph.output_node().args[0]
        self.num_outputs = len(results) if isinstance(results, (list, tuple)) else 1
        self.eager_reason: str | None = None
        self._told_eager = False  # the eager fallback is logged once per graph
        self.eager_calls = 0  # calls that ran the graph's ops eagerly on dtorch tensors (no shipped program)
        #: symbolic sizes (dynamic=True): the SymInt inputs, and one graph program per input layout where sound
        #: (:mod:`~torch_dtorch.backend.symbolic`)
        self._sizes = frozenset(sym_positions(fake_inputs))
        self.symbolic = bool(self._sizes) or any(not isinstance(s, int) for x in tensors for s in x.shape)
        self._sym_variants: dict[Any, SymbolicVariant] = {}
        if self.symbolic and (records is not None or grad_targets is not None):
            self.eager_reason = (
                "symbolic (dynamic) shapes in a training graph; pass dynamic=False to torch.compile"
            )
        self._variants: dict[Any, _Variant] = {}
        #: (generation, layout id of each input) -> variant: the per-call lookup
        self._fast: dict[tuple[int, ...], _Variant] = {}
        self._memo = CallKeyMemo()
        self._lock = threading.Lock()
        self._plain_fn: Callable[..., Any] | None = None
        self.reports: list[CompileReport] = []

    # --- calls --------------------------------------------------------------------------------------------------
    def __call__(self, args: list[Any]) -> list[Any]:
        """One call: the hot path looks the variant up by the inputs' layout ids (interned per tensor, as in the
        eager fast path), makes the outputs and appends one ``RunProgram`` under one executor lock."""
        rt = _state._SESSION
        fast = self._fast
        if fast and rt is not None:
            key = self._memo.key(rt.generation, args)
            if key is not None:
                variant = fast.get(key[0])
                if variant is not None:
                    return self._run(rt, variant, key[1], args)
        return self._call_slow(args)

    def _run(self, rt: Session, variant: _Variant, in_ids: list[int], args: list[Any]) -> list[Any]:
        pid = variant.program_id
        if self.records is not None:
            self.records.record(variant.prop.inputs, self.num_inputs)
        in_ids.extend(variant.constant_ids)
        ins = tuple(in_ids)
        executor = rt.executor
        outs = executor.append_with_outputs(
            variant.out_specs, lambda ys: RunProgram(pid, ins, tuple([y.id for y in ys]))
        )
        # boxed convention: drop the inputs now, so that the Free of those that die (a backward's saved activations)
        # follows the RunProgram in the same batch and the workers donate them to the program (``program.py``)
        args.clear()
        executor.flush()  # (drains the tensor table's frees first); a whole compiled program starts on the workers now
        gen = rt.generation
        on_free = _free_callback(rt)
        table_wrap = TABLE.wrap
        tensors = [table_wrap(y, gen, on_free, layout=lid) for y, lid in zip(outs, variant.out_layouts)]
        recipe = variant.recipe
        if recipe is None:
            return tensors
        it = iter(tensors)
        return [next(it) if is_operand else value for is_operand, value in recipe]

    def _call_slow(self, args: list[Any]) -> list[Any]:
        if self.plain:
            return self._call_plain(args)
        if self.symbolic and self.eager_reason is None and not self.debug:
            result = self._call_symbolic(args)
            if result is not None:
                return result
        if self.eager_reason is not None:
            if not self._told_eager:
                self._told_eager = True
                log.warning(
                    "%s: this compiled graph runs its ops eagerly on dtorch tensors (one fast-path op at a time, no "
                    "shipped program): %s",
                    self.backend,
                    self.eager_reason,
                )
            self.eager_calls += 1
            return list(self.gm(*args))
        rt = get_session()
        operands = self._operands(rt, args)
        targets = self.grad_targets.targets(self.num_outputs) if self.grad_targets is not None else None
        key = (rt.generation, tuple((x.mesh, x.placements) for x in operands), targets)
        variant = self._variants.get(key)
        if variant is None:
            variant = self._compile(rt, key, operands, targets)
            if variant is None:
                self.eager_calls += 1
                return list(self.gm(*args))
        hot = fast_key(rt.generation, args)
        if hot is not None:  # later calls with these layouts take the hot path
            if len(self._fast) >= _MAX_FAST_KEYS:
                self._fast.clear()
            self._fast[hot[0]] = variant
        scalars = [x for x in operands if x.tag == _SCALAR_TAG]
        result = self._run(rt, variant, [x.id for x in operands], args)
        for x in scalars:  # uploaded for this call only (the Free follows the RunProgram)
            rt.executor.free(x)
        return result

    def _call_symbolic(self, args: list[Any]) -> list[Any] | None:
        """A graph with symbolic sizes: its graph program for these input layouts (``None``: run it eagerly)."""
        rt = get_session()
        operands: list[Any] = self._operands(rt, args)
        key = (rt.generation, tuple(None if x is None else (x.mesh, x.placements) for x in operands))
        variant = self._sym_variants.get(key)
        if variant is None:
            variant = self._compile_symbolic(rt, key, operands, args)
        scalars = [x for x in operands if x is not None and x.tag == _SCALAR_TAG]
        result = None if variant is None else run_symbolic(rt, variant, operands, args)
        for x in scalars:  # uploaded for this call only
            rt.executor.free(x)
        return result

    def _compile_symbolic(
        self, rt: Session, key: Any, operands: list[Operand | None], args: Sequence[Any]
    ) -> SymbolicVariant | None:
        with self._lock:
            hit = self._sym_variants.get(key)
            if hit is not None:
                return hit
            report = CompileReport(
                self.aten_text, inputs=_describe_key([x for x in operands if x is not None])
            )
            variant, why = plan_symbolic(
                rt,
                self.gm,
                operands,
                args,
                self.options.redistribute,
                next(_PROGRAM_IDS),
                report,
                worker_compiler=self.options.worker_compiler,
            )
            if variant is None:
                self.eager_reason = why
                report.error = why
                self._publish(report)
                return None
            self._publish(report)
            self._sym_variants[key] = variant
            log.debug("%s: graph program %d for symbolic sizes", self.backend, variant.program_id)
            return variant

    def _operands(self, rt: Session, args: Sequence[Any]) -> list[Operand]:
        if len(args) != self.num_inputs:
            raise TypeError(
                f"{self.backend}: compiled graph called with {len(args)} inputs, expects {self.num_inputs}"
            )
        operands: list[Operand | None] = []
        pending: list[int] = []
        scalars: dict[int, torch.Tensor] = {}
        mesh: DeviceMesh | None = None
        for i, a in enumerate(args):
            if i in self._sizes:  # a SymInt input: its value travels with the call
                operands.append(None)
                continue
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"{self.backend}: input {i} is {type(a).__name__}, expected a tensor")
            if a.device.type == DEVICE_NAME:
                x = TABLE.lookup(a, rt.generation)
            elif a.dim() == 0:  # a Python-number-like CPU scalar: uploaded Replicate for this call
                x = Operand(-1, (), a.dtype, None, (), tag=_SCALAR_TAG)
                scalars[i] = a
            else:
                raise DeviceMismatchError(
                    f"{self.backend}: input {i} is a {a.device} tensor of shape {tuple(a.shape)} next to dtorch "
                    "tensors; move it with t.to('dtorch') or dt.distribute_tensor(t, mesh, placements)"
                )
            if x.mesh is None:
                pending.append(i)
            elif mesh is None:
                mesh = x.mesh
            operands.append(x)
        if pending:
            bind_mesh = mesh or binding.fallback_mesh(rt, f"{self.backend} compiled graph")
            for i in pending:
                pend = operands[i]
                assert pend is not None
                if i in scalars:
                    y = rt.executor.input(
                        (), bind_mesh, [Replicate()] * bind_mesh.ndim, dtype=pend.dtype, tag=_SCALAR_TAG
                    )
                    rt.executor.upload(y, scalars[i].detach().cpu())
                    operands[i] = y
                else:
                    operands[i] = binding.bind(rt, pend, bind_mesh)
        return operands  # type: ignore[return-value]

    # --- compiling a variant ------------------------------------------------------------------------------------
    def _compile(
        self,
        rt: Session,
        key: Any,
        operands: list[Operand],
        targets: tuple[OutTarget | None, ...] | None = None,
    ) -> _Variant | None:
        with self._lock:
            hit = self._variants.get(key)
            if hit is not None:
                return hit
            report = CompileReport(self.aten_text, inputs=_describe_key(operands))
            # inputs may live on several root meshes (pipeline stages): the program spans all of their devices,
            # each rank runs the operators assigned to it, stage moves are point-to-point collective steps
            mesh = next(x.mesh for x in operands if x.mesh is not None)
            specs = [InputSpec(x.shape, x.dtype, x.mesh, x.placements) for x in operands]
            try:
                prop = propagate(
                    self.gm, specs, mesh=mesh, policy=self.options.redistribute, out_targets=targets
                )
            except UnsupportedGraphError as e:
                log.warning("%s: running this graph eagerly on dtorch tensors: %s", self.backend, e)
                self.eager_reason = str(e)
                self._told_eager = True
                report.error = str(e)
                self._publish(report)
                return None
            root = mesh.root
            devices = prop.source().devices
            check_cudagraph_devices(
                self.options, {d: rt.torch_device(d) for d in devices}, backend=self.backend
            )
            programs = {d: build_local_program(prop, d, rt.torch_device(d)) for d in devices}
            report.logical = str(prop.graph)
            report.local = {d: str(p) for d, p in programs.items()}
            self._publish(report)
            if self.debug:
                self.eager_reason = "dtorch_debug backend (graphs shown, run eagerly)"
                self._told_eager = True
                return None
            ex = rt.executor
            constants: list[torch.Tensor] = []
            constant_ids: list[int] = []
            first_constant = len(prop.inputs) - len(prop.constants)
            for value, x in zip(prop.constants, prop.inputs[first_constant:], strict=True):
                c = ex.input(
                    tuple(value.shape), x.mesh, x.placements, dtype=value.dtype
                )  # the mesh it is used on
                ex.upload(c, value.to("cpu") if value.device.type != "cpu" else value)
                constants.append(wrap(rt, c))
                constant_ids.append(c.id)
            pid = next(_PROGRAM_IDS)
            # parameters, buffers and the graph constants uploaded above keep their tensors from call to call
            static = (
                *(i for i in self.static_inputs if i < first_constant),
                *range(first_constant, len(prop.inputs)),
            )
            _submit(
                ex,
                LoadProgram(
                    pid,
                    programs,
                    worker_compiler=self.options.worker_compiler,
                    cudagraphs=self.options.cudagraphs,
                    source=prop.source(),
                    static_inputs=static,
                ),
            )
            variant = _Variant(pid, prop, programs, constants, tuple(constant_ids), prop.outputs, report)
            variant.finalizer = weakref.finalize(variant, _unload, rt.generation, pid)
            self._variants[key] = variant
            log.debug(
                "%s: compiled variant %d for %s (%d ops, %d collectives on device %d)",
                self.backend,
                pid,
                ", ".join(placements_str(x.placements) for x in operands),
                len(prop.graph),
                programs[root.devices[0]].num_collectives,
                root.devices[0],
            )
            return variant

    def _publish(self, report: CompileReport) -> None:
        self.reports.append(report)
        if self.options.reports is not None:
            self.options.reports.append(report)
        if self.debug:
            out = self.options.file if self.options.file is not None else sys.stdout
            out.write(str(report))

    # --- plain torch inputs -------------------------------------------------------------------------------------
    def _call_plain(self, args: list[Any]) -> list[Any]:
        fn = self._plain_fn
        if fn is None:
            fn = self._plain_compile(args)
        return list(fn(*args))

    def _plain_compile(self, args: Sequence[Any]) -> Callable[..., Any]:
        with self._lock:
            if self._plain_fn is not None:
                return self._plain_fn
            report = CompileReport(self.aten_text)
            mesh = DeviceMesh.from_shape(self.device_type, (1,))
            specs = [
                InputSpec(tuple(a.shape), a.dtype, mesh, (Replicate(),))
                for a in args
                if isinstance(a, torch.Tensor)
            ]
            report.inputs = [
                f"in{i}: {s.dtype} {list(s.shape)} R on a 1-device mesh" for i, s in enumerate(specs)
            ]
            if len(specs) != len(args):  # symbolic sizes (dynamic=True) come as SymInt inputs
                report.error = "non-tensor graph inputs (symbolic sizes): the captured graph runs as it is"
            else:
                try:
                    prop = propagate(self.gm, specs, mesh=mesh, policy=self.options.redistribute)
                    report.logical = str(prop.graph)
                    report.local = {0: str(build_local_program(prop, 0))}
                except (DTorchError, NotImplementedError) as e:
                    # a 1-device program is the captured graph itself: nothing to propagate for execution
                    report.error = f"{type(e).__name__}: {e}".splitlines()[0]
            self._publish(report)
            fn: Callable[..., Any] = self.gm.forward
            if self.options.worker_compiler == "inductor":
                fn = _compile_in_thread(_fresh_copy(self.gm), list(args), self.static_inputs)
            self._plain_fn = fn
            return fn

    @property
    def num_variants(self) -> int:
        """Compiled variants: input layouts with their own programs (graphs with symbolic sizes: one each)."""
        return len(self._variants) + len(self._sym_variants)


def _fresh_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` without aot's node metadata (its fake/functional values must not leak into a new inductor trace)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for node in graph.nodes:
        node.meta = {}
    return fx.GraphModule(gm, graph)


def _compile_in_thread(
    gm: fx.GraphModule, args: list[Any], static_inputs: Sequence[int] = ()
) -> Callable[..., Any]:
    """Inductor-compile on a fresh thread: the first call still runs inside the outer compile's thread-local
    tracing state (aot/dynamo contexts), which a nested inductor trace must not see. Workers compile on their own
    threads anyway."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["fn"] = _compat.inductor_compile(
                gm,
                args,
                static_input_idxs=static_inputs,
                decompositions=inductor_decompositions_for(gm, args),
            )
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, name="dtorch-inductor-compile")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["fn"]  # type: ignore[no-any-return]
