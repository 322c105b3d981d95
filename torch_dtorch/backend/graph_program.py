"""Programs of graphs with symbolic sizes: the captured aten graph itself, run by every rank on its local tensors.

A graph whose every operand is whole on every rank (Replicate on each mesh axis of more than one device:
:mod:`~torch_dtorch.backend.symbolic` checks it) needs no localization — each rank's program is the captured graph,
its ``dtorch`` devices replaced by the rank's torch device. It keeps the graph's SymInt placeholders: each
:class:`~torch_dtorch.backend.program.RunProgram` carries the call's sizes (``sym_values``), so one program serves
every size.

:class:`GraphSource` is the portable form of such a graph (nodes as plain trees: aten overloads by name, the
Python size arithmetic from a fixed table, constants through the codec), shipped once by :class:`LoadGraphProgram`;
each worker builds its :class:`~torch_dtorch.backend.local.LocalProgram` from it — one compute segment.
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from torch_dtorch import _compat
from torch_dtorch.backend.local import LocalMeta, LocalProgram, Segment
from torch_dtorch.backend.place import PLACE_AS_OP, PLACE_OP
from torch_dtorch.backend.program import install_program
from torch_dtorch.device.tensors import DEVICE_NAME
from torch_dtorch.executor.worker import Worker, register_instruction
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement_rules.ranks import takes_device

__all__ = ["PY_TARGETS", "GraphSource", "LoadGraphProgram", "build_graph_program", "graph_source"]

log = logging.getLogger(__name__)


def _py_targets() -> dict[str, Any]:
    names: dict[str, Any] = {
        f"operator.{n}": getattr(operator, n)
        for n in ("add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow", "eq", "ne", "lt", "le")
        + ("gt", "ge", "and_", "or_", "not_", "getitem")
    }
    names.update({f"math.{n}": getattr(math, n) for n in ("ceil", "floor", "sqrt", "trunc")})
    names.update(
        {f"torch.{n}": getattr(torch, n) for n in ("sym_int", "sym_float", "sym_max", "sym_min", "sym_not")}
    )
    return names


#: the Python functions a symbolic graph may call (size arithmetic), by the name they travel under
PY_TARGETS: dict[str, Any] = _py_targets()
_PY_NAMES: dict[Any, str] = {f: n for n, f in PY_TARGETS.items()}
_ALLOWED_NAMESPACES = ("aten", "prims")


class UnportableGraphError(ValueError):
    """A node a graph program cannot carry (a higher-order op, an unknown Python call, a random op)."""


class _RankDevice:
    """Stands for the ``dtorch`` device in a portable graph: each rank puts its own torch device there."""

    def __repr__(self) -> str:
        return "<rank device>"


RANK_DEVICE = _RankDevice()


@dataclass(frozen=True)
class GraphSource:
    """A captured graph in portable form. ``nodes``: per node ``("p",)`` (a placeholder),
    ``("c", target, args, kwargs)`` (a call: arguments hold :class:`NodeRef` and :data:`RANK_DEVICE`) or
    ``("o", results)``. ``in_meta``: a tensor input's (hint shape, dtype), ``None`` for a SymInt input."""

    mesh: DeviceMesh
    nodes: tuple[tuple[Any, ...], ...]
    in_meta: tuple[LocalMeta | None, ...]
    out_meta: tuple[LocalMeta, ...]
    #: per input, what the workers' inductor compiles it as (``_compat.inductor_compile_symbolic``): a tensor's dims
    #: (an int, or the name of the size symbol the controller's graph has there) and dtype, or a size input's
    #: symbol name; empty where an input's size is not a plain symbol (the program then runs uncompiled)
    in_syms: tuple[Any, ...] = ()

    @property
    def devices(self) -> tuple[int, ...]:
        return tuple(self.mesh.root.devices)

    @property
    def sym_inputs(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.in_meta) if m is None)


@dataclass(frozen=True)
class NodeRef:
    index: int


def _portable(value: Any, index: dict[fx.Node, int]) -> Any:
    if isinstance(value, fx.Node):
        return NodeRef(index[value])
    if isinstance(value, (list, tuple)):
        items = [_portable(v, index) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _portable(v, index) for k, v in value.items()}
    if isinstance(value, torch.device) and value.type == DEVICE_NAME:
        return RANK_DEVICE
    return value


def _check_target(node: fx.Node) -> None:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        if t in (PLACE_OP, PLACE_AS_OP):
            return
        if t.namespace not in _ALLOWED_NAMESPACES:
            raise UnportableGraphError(f"{node.format_node()}: {t} is not an aten/prims op")
        if torch.Tag.nondeterministic_seeded in t.tags and not _no_dropout(node, t):
            raise UnportableGraphError(
                f"{node.format_node()}: random op {t} (its RNG stream is not replayed)"
            )
        return
    if t not in _PY_NAMES:
        raise UnportableGraphError(f"{node.format_node()}: {t} is neither an aten op nor size arithmetic")


def _no_dropout(node: fx.Node, op: torch._ops.OpOverload) -> bool:
    """A random op whose only randomness is dropout, called with ``dropout_p=0`` (attention at inference)."""
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dropout_p":
            p = node.kwargs.get("dropout_p", node.args[i] if i < len(node.args) else a.default_value)
            return bool(p == 0)
    return False


def graph_source(gm: fx.GraphModule, mesh: DeviceMesh, constants: Sequence[fx.Node] = ()) -> GraphSource:
    """``gm`` in portable form; its tensor ``get_attr`` nodes (``constants``) become extra placeholders after the
    inputs (their values are uploaded once and passed at every call). Raises :class:`UnportableGraphError`."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index: dict[fx.Node, int] = {}
    nodes: list[tuple[Any, ...]] = []
    in_meta: list[LocalMeta | None] = []
    in_syms: list[Any] | None = []
    for n in [*placeholders, *constants]:
        index[n] = len(nodes)
        nodes.append(("p",))
        val = n.meta.get("val") if n.op == "placeholder" else getattr(gm, str(n.target))
        if isinstance(val, torch.Tensor):
            in_meta.append((tuple(_compat.sym_hint(s) for s in val.shape), val.dtype))
        else:
            in_meta.append(None)
        if in_syms is not None:
            spec = _sym_spec(val)
            in_syms = None if spec is None else [*in_syms, spec]
    out_meta: list[LocalMeta] = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            if n.op == "get_attr" and n not in index:
                raise UnportableGraphError(
                    f"{n.format_node()}: a graph attribute that is not a tensor constant"
                )
            continue
        if n.op == "output":
            results = n.args[0] if isinstance(n.args[0], (list, tuple)) else [n.args[0]]
            tensors: list[NodeRef | None] = []
            for (
                r
            ) in results:  # the program's outputs: the tensors (sizes and constants stay on the controller)
                val = r.meta.get("val") if isinstance(r, fx.Node) else None
                if isinstance(val, torch.Tensor):
                    out_meta.append((tuple(_compat.sym_hint(s) for s in val.shape), val.dtype))
                    tensors.append(NodeRef(index[r]))
                else:
                    tensors.append(None)
            nodes.append(("o", tuple(tensors)))
            break
        if n.op != "call_function":
            raise UnportableGraphError(f"{n.format_node()}: FX node kind {n.op!r}")
        _check_target(n)
        index[n] = len(nodes)
        args, kwargs = _portable((n.args, dict(n.kwargs)), index)
        nodes.append(("c", n.target, args, kwargs))
    return GraphSource(mesh, tuple(nodes), tuple(in_meta), tuple(out_meta), tuple(in_syms or ()))


def _sym_name(s: Any) -> int | str | None:
    """A size as :attr:`GraphSource.in_syms` names it: an int, a plain symbol's name, or ``None`` (an expression)."""
    if isinstance(s, int):
        return s
    e = _compat.sym_expr(s)
    if getattr(e, "is_Integer", False):
        return int(e)
    return str(e) if getattr(e, "is_Symbol", False) else None


def _sym_spec(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        dims = tuple(_sym_name(s) for s in val.shape)
        return None if None in dims else (dims, val.dtype)
    name = _sym_name(val) if isinstance(val, (int, torch.SymInt)) else None
    return name if isinstance(name, str) else None


def _local(value: Any, env: list[Any], device: torch.device) -> Any:
    if type(value) is NodeRef:
        return env[value.index]
    if value is RANK_DEVICE or isinstance(value, _RankDevice):
        return device
    if isinstance(value, (list, tuple)):
        items = [_local(v, env, device) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _local(v, env, device) for k, v in value.items()}
    return value


def build_graph_program(src: GraphSource, device: int, torch_device: torch.device) -> LocalProgram:
    """Rank ``device``'s program: the graph on ``torch_device``, one compute segment; program outputs are its
    tensor results (each its own tensor), SymInt inputs are filled from each call's ``sym_values``."""
    g = fx.Graph()
    env: list[Any] = []
    num_inputs = 0
    for i, rec in enumerate(src.nodes):
        kind = rec[0]
        if kind == "p":
            node = g.placeholder(f"in{i}")
            node.meta["local"] = src.in_meta[i]
            env.append(node)
            num_inputs += 1
        elif kind == "c":
            target: Any = rec[1]
            args, kwargs = _local((rec[2], rec[3]), env, torch_device)
            if target in (PLACE_OP, PLACE_AS_OP):  # every operand is whole on every rank: nothing moves
                env.append(args[0])
                continue
            if torch_device.type != "cpu" and kwargs.get("device") is None and takes_device(target):
                kwargs = {**kwargs, "device": torch_device}
            env.append(g.call_function(target, tuple(args), kwargs))
        else:
            outs: list[fx.Node] = []
            for r in _local(rec[1], env, torch_device):
                if r is None:
                    continue
                if (
                    r.op == "placeholder" or r in outs
                ):  # every output its own tensor (see local._distinct_outputs)
                    r = g.call_function(torch.ops.aten.clone.default, (r,))
                outs.append(r)
            g.output(tuple(outs))
    g.lint()
    gm = fx.GraphModule(torch.nn.Module(), g)
    seg_in = tuple(range(num_inputs))
    seg_out = tuple(range(num_inputs, num_inputs + len(src.out_meta)))
    seg = Segment(gm, seg_in, seg_out, src.out_meta)
    return LocalProgram(
        device,
        g,
        [seg],
        num_inputs,
        num_inputs + len(src.out_meta),
        seg_out,
        src.in_meta,
        sym_inputs=src.sym_inputs,
        sym_specs=src.in_syms,
    )


@dataclass(frozen=True, slots=True)
class LoadGraphProgram:
    """Each worker of ``source.mesh`` builds and keeps the graph program ``program_id`` (see module docstring)."""

    program_id: int
    source: GraphSource
    worker_compiler: str = "eager"


@register_instruction(LoadGraphProgram)
def _load(worker: Worker, instr: LoadGraphProgram) -> None:
    if worker.device not in instr.source.devices:
        return
    name = f"compiled program {instr.program_id} (symbolic sizes)"
    try:
        program: LocalProgram | BaseException = build_graph_program(
            instr.source, worker.device, worker.torch_device
        )
    except Exception as e:  # noqa: BLE001 - handlers never raise: every call of the program fails instead
        log.exception("worker %d: building %s failed", worker.device, name)
        program = e
    install_program(worker, instr.program_id, program, instr.worker_compiler, name)


# --- process mode: the codec ---------------------------------------------------------------------------------------


def _enc(value: Any, ctx: Any) -> Any:
    t = type(value)
    if t is NodeRef:
        return ["N", value.index]
    if value is RANK_DEVICE or t is _RankDevice:
        return ["RD"]
    if t is list or t is tuple:
        return ["L" if t is list else "T", *[_enc(v, ctx) for v in value]]
    if t is dict:
        return ["D", *[[k, _enc(v, ctx)] for k, v in value.items()]]
    return ["V", ctx.value(value)]


def _dec(tree: Any, ctx: Any) -> Any:
    tag = tree[0]
    if tag == "N":
        return NodeRef(int(tree[1]))
    if tag == "RD":
        return RANK_DEVICE
    if tag in ("L", "T"):
        items = [_dec(v, ctx) for v in tree[1:]]
        return items if tag == "L" else tuple(items)
    if tag == "D":
        return {str(k): _dec(v, ctx) for k, v in tree[1:]}
    return ctx.value(tree[1])


def _enc_meta(m: LocalMeta | None) -> Any:
    return None if m is None else [list(m[0]), str(m[1]).removeprefix("torch.")]


def _dec_meta(tree: Any) -> LocalMeta | None:
    if tree is None:
        return None
    dtype = getattr(torch, str(tree[1]))
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype: {tree[1]!r}")
    return tuple(int(s) for s in tree[0]), dtype


def _enc_spec(spec: Any) -> Any:
    return spec if isinstance(spec, str) else [list(spec[0]), str(spec[1]).removeprefix("torch.")]


def _dec_spec(tree: Any) -> Any:
    if isinstance(tree, str):
        return tree
    dims = tuple(d if isinstance(d, str) else int(d) for d in tree[0])
    meta = _dec_meta([[0] * len(dims), tree[1]])
    assert meta is not None
    return dims, meta[1]


def _register_codecs() -> None:
    from torch_dtorch.cluster.codec.common import CodecError, register_codec

    def enc_node(rec: tuple[Any, ...], ctx: Any) -> Any:
        if rec[0] == "p":
            return ["p"]
        if rec[0] == "o":
            return ["o", _enc(rec[1], ctx)]
        target = rec[1]
        where = ["py", _PY_NAMES[target]] if target in _PY_NAMES else ["op", ctx.op(target)]
        return ["c", where, _enc(rec[2], ctx), _enc(rec[3], ctx)]

    def dec_node(tree: Any, ctx: Any) -> tuple[Any, ...]:
        if tree[0] == "p":
            return ("p",)
        if tree[0] == "o":
            return ("o", _dec(tree[1], ctx))
        kind, name = tree[1]
        if kind == "py":
            if name not in PY_TARGETS:
                raise CodecError(f"LoadGraphProgram: unknown Python target {name!r}")
            target = PY_TARGETS[name]
        else:
            target = ctx.op(name)
        return ("c", target, _dec(tree[2], ctx), _dec(tree[3], ctx))

    def enc_load(instr: LoadGraphProgram, ctx: Any) -> Any:
        src = instr.source
        return [
            instr.program_id,
            instr.worker_compiler,
            ctx.mesh(src.mesh),
            [enc_node(rec, ctx) for rec in src.nodes],
            [_enc_meta(m) for m in src.in_meta],
            [_enc_meta(m) for m in src.out_meta],
            [_enc_spec(x) for x in src.in_syms],
        ]

    def dec_load(tree: Any, ctx: Any) -> LoadGraphProgram:
        pid, compiler, mesh_tree, node_trees, in_trees, out_trees, spec_trees = tree
        mesh = ctx.mesh(mesh_tree)
        nodes = tuple(dec_node(t, ctx) for t in node_trees)
        if mesh is None:
            raise CodecError(f"LoadGraphProgram {pid}: no mesh")
        out_meta = tuple(m for t in out_trees if (m := _dec_meta(t)) is not None)
        specs = tuple(_dec_spec(t) for t in spec_trees)
        src = GraphSource(mesh, nodes, tuple(_dec_meta(t) for t in in_trees), out_meta, specs)
        return LoadGraphProgram(int(pid), src, str(compiler))

    register_codec(LoadGraphProgram, tag="compile.graph", encode=enc_load, decode=dec_load)


try:
    _register_codecs()
except ImportError:  # pragma: no cover - a tree without the process-mode codec
    log.debug("no instruction codec: graph programs are thread-mode only")
