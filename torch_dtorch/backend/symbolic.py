"""Compiled graphs with symbolic sizes (``dynamic=True``; HF ``generate``'s decode steps with a growing KV cache):
one shipped program for every size, where that is sound.

Placements are propagated once, for the first call's sizes. They cannot depend on the sizes when every operand
— input, intermediate and output — is whole on every rank (Replicate on each mesh axis of more than one device:
always so on a 1-device mesh, and for replicated runs). Each rank's program is then the captured graph itself
(:mod:`~torch_dtorch.backend.graph_program`), with its SymInt inputs; every call passes the sizes with the
``RunProgram`` and the controller evaluates the outputs' symbolic shapes for that call. Otherwise (a sharded or
partial operand) the graph keeps running its ops eagerly on dtorch tensors, logged once.

With ``worker_compiler="inductor"`` each worker compiles the program once for every size: its inputs become fake
tensors whose dims are the graph's size symbols (``GraphSource.in_syms``, ``_compat.inductor_compile_symbolic``);
where that cannot be done (an input size that is an expression, inductor guarding a size) the program runs as
captured, logged once per program.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from torch_dtorch import _compat
from torch_dtorch.backend.graph_program import LoadGraphProgram, UnportableGraphError, graph_source
from torch_dtorch.backend.program import RunProgram, UnloadProgram
from torch_dtorch.backend.propagate import InputSpec, Propagated, propagate
from torch_dtorch.backend.report import CompileReport
from torch_dtorch.device.dispatch import _free_callback, wrap
from torch_dtorch.device.fastpath import layout_of
from torch_dtorch.device.state import Session, session_or_none
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate

__all__ = [
    "SymbolicVariant",
    "build_symbolic",
    "plan_symbolic",
    "run_symbolic",
    "sym_positions",
    "unsafe_reason",
]

log = logging.getLogger(__name__)

Env = dict[Any, int]
SizeFn = Callable[[Env], int]


def sym_positions(fake_inputs: Sequence[Any]) -> tuple[int, ...]:
    """The inputs that are sizes (SymInts: aot passes them as Python ints at every call)."""
    return tuple(i for i, x in enumerate(fake_inputs) if isinstance(x, torch.SymInt))


def _compile_expr(e: Any) -> SizeFn:
    """A closure computing the int value of a size expression for a call's symbol values (sympy ``subs`` costs tens
    of µs: too slow per call and dim)."""
    e = _compat.sym_expr(e)
    if isinstance(e, int):
        n = e
        return lambda env: n
    if e.is_Integer:
        v = int(e)
        return lambda env: v
    if e.is_Symbol:
        return lambda env: env[e]
    if e.is_Add:
        parts = [_compile_expr(a) for a in e.args]
        return lambda env: sum(p(env) for p in parts)
    if e.is_Mul and all(a.is_Integer or a.is_Symbol for a in e.args):
        parts = [_compile_expr(a) for a in e.args]
        return lambda env: math.prod(p(env) for p in parts)
    return lambda env: int(e.subs({s: env[s] for s in e.free_symbols}))


def _binders(gm: fx.GraphModule) -> list[tuple[Any, int, int | None]]:
    """``(symbol, input index, dim or None)``: where each symbol's value comes from at a call — a SymInt input, or
    a dim of a tensor input whose size is that bare symbol."""
    out: list[tuple[Any, int, int | None]] = []
    seen: set[Any] = set()
    for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        val = n.meta.get("val")
        dims: list[tuple[Any, int | None]] = []
        if isinstance(val, torch.SymInt):
            dims.append((_compat.sym_expr(val), None))
        elif isinstance(val, torch.Tensor):
            dims.extend((_compat.sym_expr(s), d) for d, s in enumerate(val.shape) if not isinstance(s, int))
        for e, d in dims:
            if getattr(e, "is_Symbol", False) and e not in seen:
                seen.add(e)
                out.append((e, i, d))
    return out


def unsafe_reason(prop: Propagated) -> str | None:
    """Why the placements found for one call's sizes may not hold for others (``None``: they hold): an operand
    not whole on every rank (sharded or partial on a mesh axis of more than one device), another mesh, or an
    operator that not every rank runs."""
    root = prop.mesh.root
    devices = tuple(root.devices)

    def check(x: Operand | None) -> str | None:
        if x is None or x.mesh is None:
            return None
        if x.mesh.root != root:
            return f"operand {x.name} lives on another mesh"
        for size, p in zip(root.shape, x.root_placements, strict=True):
            if size > 1 and not isinstance(p, Replicate):
                return f"operand {x.name} is {p} on a mesh axis of {size} devices"
        return None

    for x in prop.inputs:
        if (why := check(x)) is not None:
            return why
    for op in prop.operators:
        if op.assign is not None and tuple(sorted(op.assign.devices)) != devices:
            return f"operator {op.op} runs on some ranks only"
        for y in (*op.inputs, *op.outputs):
            if (why := check(y)) is not None:
                return why
    return None


@dataclass
class SymbolicVariant:
    """One shipped graph program for every size; per call, the outputs' metadata is evaluated from the sizes."""

    program_id: int
    binders: list[tuple[Any, int, int | None]]
    #: per graph output: ``("t", shape fns, stride fns, dtype, mesh, placements)``, ``("i", fn)`` or ``("v", value)``
    recipe: list[tuple[Any, ...]]
    constants: list[torch.Tensor]
    constant_ids: tuple[int, ...]
    finalizer: Any = field(default=None, repr=False)

    def env(self, args: Sequence[Any]) -> Env:
        env: Env = {}
        for sym, i, d in self.binders:
            a = args[i]
            env[sym] = int(a) if d is None else int(a.shape[d])
        return env


def build_symbolic(
    rt: Session,
    gm: fx.GraphModule,
    prop: Propagated,
    program_id: int,
    worker_compiler: str,
) -> SymbolicVariant:
    """Ship ``gm`` as one graph program over ``prop.mesh`` (raises :class:`UnportableGraphError`); ``prop``
    (checked with :func:`unsafe_reason`) gives the outputs' layouts."""
    mesh = prop.mesh
    constants_nodes = [
        n for n in gm.graph.nodes if n.op == "get_attr" and isinstance(_attr(gm, n), torch.Tensor)
    ]
    src = graph_source(gm, mesh, constants_nodes)
    ex: Any = rt.executor
    constants: list[torch.Tensor] = []
    constant_ids: list[int] = []
    for n in constants_nodes:
        value = _attr(gm, n).detach()
        c = ex.input(tuple(value.shape), mesh, [Replicate()] * mesh.ndim, dtype=value.dtype)
        ex.upload(c, value.to("cpu") if value.device.type != "cpu" else value)
        constants.append(wrap(rt, c))
        constant_ids.append(c.id)
    recipe = _recipe(gm, prop)
    ex.append_instruction(LoadGraphProgram(program_id, src, worker_compiler))
    variant = SymbolicVariant(program_id, _binders(gm), recipe, constants, tuple(constant_ids))
    variant.finalizer = weakref.finalize(variant, _unload, rt.generation, program_id)
    return variant


def plan_symbolic(
    rt: Session,
    gm: fx.GraphModule,
    operands: Sequence[Operand | None],
    args: Sequence[Any],
    policy: Any,
    program_id: int,
    report: CompileReport,
    *,
    worker_compiler: str = "eager",
) -> tuple[SymbolicVariant | None, str]:
    """Propagate ``gm`` for this call's sizes; where sound, ship its graph program (run by ``worker_compiler``:
    ``"inductor"`` compiles it once for every size). Returns the variant, or ``None`` and why the graph runs
    eagerly (the log's and the report's text)."""
    failed = False
    try:
        prop = propagate(
            gm, input_specs(operands, args), mesh=first_mesh(operands), policy=policy, symbolic=True
        )
        report.logical = str(prop.graph)
        why = unsafe_reason(prop)
        if why is None:
            variant = build_symbolic(rt, gm, prop, program_id, worker_compiler)
            report.local = {d: "the captured graph (symbolic sizes)" for d in prop.mesh.root.devices}
            return variant, ""
    except Exception as e:  # noqa: BLE001 - any failure keeps the eager fallback, logged with its reason
        log.debug("no graph program for this graph with symbolic sizes", exc_info=True)
        why, failed = f"{type(e).__name__}: {e}".splitlines()[0], True
    said = f"no graph program ({why})" if failed else f"and the placements may depend on the sizes ({why})"
    return None, f"symbolic (dynamic) shapes, {said}; pass dynamic=False to torch.compile"


def _attr(gm: fx.GraphModule, n: fx.Node) -> Any:
    obj: Any = gm
    for part in str(n.target).split("."):
        obj = getattr(obj, part)
    return obj


def _recipe(gm: fx.GraphModule, prop: Propagated) -> list[tuple[Any, ...]]:
    results = gm.graph.output_node().args[0]
    results = list(results) if isinstance(results, (list, tuple)) else [results]
    recipe: list[tuple[Any, ...]] = []
    for r, o in zip(results, prop.outputs, strict=True):
        val = r.meta.get("val") if isinstance(r, fx.Node) else r
        if isinstance(val, torch.Tensor):
            if not isinstance(o, Operand) or o.mesh is None:
                raise UnportableGraphError(f"output {r} has no layout after propagation")
            shape = tuple(_compile_expr(s) for s in val.shape)
            stride = tuple(_compile_expr(s) for s in val.stride())
            recipe.append(("t", shape, stride, val.dtype, o.mesh, o.placements))
        elif isinstance(val, torch.SymInt):
            recipe.append(("i", _compile_expr(val)))
        elif isinstance(val, (int, float, bool)) or val is None:
            recipe.append(("v", val))
        else:
            raise UnportableGraphError(
                f"output {r}: a {type(val).__name__} (not a tensor, a size or a constant)"
            )
    return recipe


def run_symbolic(
    rt: Session, variant: SymbolicVariant, operands: Sequence[Operand | None], args: list[Any]
) -> list[Any]:
    """One call: the sizes go with the ``RunProgram``; the output tensors get this call's shapes."""
    env = variant.env(args)
    sym_values = tuple(int(a) for a, x in zip(args, operands) if x is None)
    specs: list[tuple[Any, ...]] = []
    for item in variant.recipe:
        if item[0] == "t":
            _, shape, stride, dtype, mesh, placements = item
            specs.append(
                (tuple(f(env) for f in shape), dtype, mesh, placements, tuple(f(env) for f in stride))
            )
    ins = (*(x.id if x is not None else -1 for x in operands), *variant.constant_ids)
    pid = variant.program_id
    outs = rt.executor.append_with_outputs(
        specs, lambda ys: RunProgram(pid, ins, tuple([y.id for y in ys]), sym_values=sym_values), flush=True
    )
    args.clear()
    gen = rt.generation
    on_free = _free_callback(rt)
    it = iter(outs)
    result: list[Any] = []
    for item in variant.recipe:
        if item[0] == "t":
            y = next(it)
            result.append(TABLE.wrap(y, gen, on_free, layout=layout_of(y)))
        elif item[0] == "i":
            result.append(item[1](env))
        else:
            result.append(item[1])
    return result


def input_specs(operands: Sequence[Operand | None], args: Sequence[Any]) -> list[InputSpec | int]:
    """Propagation specs of one call: tensor layouts with this call's shapes, each size's value."""
    return [
        int(a) if x is None else InputSpec(x.shape, x.dtype, x.mesh, x.placements)
        for x, a in zip(operands, args, strict=True)
    ]


def first_mesh(operands: Sequence[Operand | None]) -> DeviceMesh:
    return next(x.mesh for x in operands if x is not None and x.mesh is not None)


def _unload(generation: int, program_id: int) -> None:
    rt = session_or_none()
    if rt is None or rt.generation != generation or rt.executor.closed:
        return
    try:
        executor: Any = rt.executor
        executor.append_instruction(UnloadProgram(program_id))
    except Exception:  # noqa: BLE001 - best effort from a finalizer
        log.debug("unloading graph program %d failed", program_id, exc_info=True)
