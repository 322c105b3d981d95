"""One rank's local program: the LogicalGraph localized for one device, as an FX graph with its collectives.

Every operator becomes what the eager worker would run for it on that rank — the rule's ``localize`` (evaluated
once, at compile time, with the rank's local shapes) and its local kernel — and every ``redistribute`` becomes a
collective node carrying its :class:`~torch_dtorch.placement_rules.redistribute.planner.RedistributePlan`. The program is then
cut at the collectives into **compute segments** (plain aten FX graphs a worker may hand to inductor) and
**collective steps** (run with the worker's communicator), connected through numbered value slots. An operator
whose rule kernel itself communicates (context-parallel attention: ring K/V passing, Ulysses all-to-all) becomes a
**kernel step**, run like a collective with the worker's communicator in its :class:`LocalContext`.

A program may span several meshes (pipeline stages): a rank runs only the operators assigned to it, and a
redistribute between meshes is a collective step whose input (or output) slot is ``None`` on the ranks outside its
source (or destination) mesh.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx

from torch_dtorch.backend.capture import format_value, target_name
from torch_dtorch.executor.constructor import REDISTRIBUTE
from torch_dtorch.graph import Operand, Operator
from torch_dtorch.graph.operand import dtype_str
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement_rules import OpRule
from torch_dtorch.placement_rules.call import LocalContext, map_operands
from torch_dtorch.placement_rules.families.context_parallel import kernel_needs_comm
from torch_dtorch.placement_rules.ranks import cached_local_shape_and_offset, takes_device
from torch_dtorch.placement_rules.rule import FunctionRule

__all__ = [
    "CollectiveStep",
    "KernelStep",
    "LocalProgram",
    "ProgramSource",
    "Segment",
    "build_local_program",
    "comm_kernel",
    "redistribute",
]

LocalMeta = tuple[tuple[int, ...], torch.dtype]


def redistribute(x: torch.Tensor) -> torch.Tensor:
    """Marker target of collective nodes in a local program (the program runner executes them with the worker's
    communicator; the node's ``meta["plan"]`` says what to do)."""
    raise RuntimeError(
        "redistribute nodes of a dtorch local program run through the program runner, not as a Python call"
    )


def comm_kernel(*args: Any, **kwargs: Any) -> Any:
    """Marker target of operators whose rule kernel communicates (``meta["kernel"]`` holds rule, call, context);
    the program runner calls the kernel with the worker's communicator."""
    raise RuntimeError("communicating kernels of a dtorch local program run through the program runner")


@dataclass(frozen=True)
class ProgramSource:
    """What every rank's local program is built from: the propagated operators and their boundary (the part of a
    :class:`~torch_dtorch.backend.propagate.Propagated` that travels to worker processes, which then localize it
    themselves)."""

    mesh: DeviceMesh
    inputs: Sequence[Operand]
    operators: Sequence[Operator]
    outputs: Sequence[Operand | Any]

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device with work in the program: the meshes of its inputs and the devices of its operators
        (several stage meshes for a pipeline)."""
        devs = set(self.mesh.root.devices)
        for x in self.inputs:
            if x.mesh is not None:
                devs.update(x.mesh.root.devices)
        for op in self.operators:
            if op.assign is not None:
                devs.update(op.assign.devices)
        return tuple(sorted(devs))


@dataclass
class Segment:
    """A compute segment: ``gm(*slots[in_slots]) -> slots[out_slots]`` (no collective inside)."""

    gm: fx.GraphModule
    in_slots: tuple[int, ...]
    out_slots: tuple[int, ...]
    out_meta: tuple[LocalMeta, ...]
    release: tuple[int, ...] = ()


@dataclass
class CollectiveStep:
    """``slots[out_slot] = execute_plan(plan, slots[in_slot])``; ``None`` slots where the device is outside a mesh."""

    plan: Any
    note: str
    in_slot: int | None
    out_slot: int
    in_meta: LocalMeta | None
    out_meta: LocalMeta | None
    release: tuple[int, ...] = ()


@dataclass(frozen=True)
class SlotRef:
    """Where a :class:`KernelStep` argument comes from."""

    slot: int


@dataclass
class KernelStep:
    """``slots[out_slot] = rule.kernel(call, ctx + worker comm, *args)`` (``SlotRef`` arguments read from slots):
    an operator whose local kernel communicates, run between segments like a collective."""

    rule: Any
    call: Any
    ctx: LocalContext
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    in_slots: tuple[int, ...]
    out_slot: int
    out_meta: Any
    note: str
    release: tuple[int, ...] = ()

    def with_comm(self, comm: Any, seq: int | None = None) -> LocalContext:
        """The step's context for one call: the worker's communicator and the call's number (``seq``)."""
        return replace(self.ctx, comm=comm, seq=seq)


Step = Segment | CollectiveStep | KernelStep


@dataclass
class LocalProgram:
    """Everything one worker needs to replay a compiled graph."""

    device: int
    graph: fx.Graph
    steps: list[Step]
    num_inputs: int
    num_slots: int
    out_slots: tuple[int | None, ...]
    in_meta: tuple[LocalMeta | None, ...]
    names: dict[str, str] = field(default_factory=dict)
    #: inputs that are sizes (a graph with symbolic sizes): each call's ``RunProgram.sym_values``, in order
    sym_inputs: tuple[int, ...] = ()
    #: a graph with symbolic sizes: per input, what the workers' inductor compiles it as (see
    #: ``GraphSource.in_syms``); empty: inductor cannot compile it for every size
    sym_specs: tuple[Any, ...] = ()

    def __str__(self) -> str:
        return format_local_program(self.graph)

    @property
    def num_collectives(self) -> int:
        """Steps that talk to other ranks (collectives and communicating kernels)."""
        return sum(not isinstance(s, Segment) for s in self.steps)


@functools.lru_cache(maxsize=4096)
def _coordinate(root: DeviceMesh, device: int) -> tuple[int, ...]:
    """``root.coordinate_of(device)``, memoized: it runs tensor ops, which are slow under the tracing modes still
    active while the first call of a compiled graph builds its programs."""
    return root.coordinate_of(device)


@functools.lru_cache(maxsize=1024)
def _devices(root: DeviceMesh) -> frozenset[int]:
    return frozenset(root.devices)


def _local_meta(x: Operand, device: int) -> LocalMeta | None:
    if x.mesh is None:
        return x.shape, x.dtype
    root = x.mesh.root
    if device not in _devices(root):
        return None
    shape, _ = cached_local_shape_and_offset(
        x.shape, root.shape, x.root_placements, _coordinate(root, device)
    )
    return shape, x.dtype


def _has_custom_kernel(rule: OpRule) -> bool:
    if type(rule).kernel is not OpRule.kernel and type(rule).kernel is not FunctionRule.kernel:
        return True
    return getattr(rule, "_kernel", None) is not None


def _kernel_target(rule: OpRule, call: Any, ctx: LocalContext) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        return rule.kernel(call, ctx, args, kwargs)

    name = target_name(call.op).replace(".", "_")
    run.__name__ = run.__qualname__ = f"dtorch_kernel_{name}"
    return run


def _returns_sequence(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    rets = schema.returns
    return len(rets) > 1 or (len(rets) == 1 and str(rets[0].type).startswith("List["))


def build_local_program(
    prop: ProgramSource | Any, device: int, torch_device: torch.device | None = None
) -> LocalProgram:
    """Localize ``prop`` (a :class:`ProgramSource`, or a :class:`~torch_dtorch.backend.propagate.Propagated`) for
    ``device``; ``torch_device`` is where the rank's factories create tensors."""
    g = fx.Graph()
    env: dict[int, fx.Node] = {}
    in_meta: list[LocalMeta | None] = []
    names: dict[str, str] = {}
    for i, x in enumerate(prop.inputs):
        node = g.placeholder(f"in{i}")
        meta = _local_meta(x, device)
        node.meta.update(local=meta, label=x.name)
        if x.tag:
            names[node.name] = x.tag
        in_meta.append(meta)
        env[x.id] = node
    for op in prop.operators:
        if op.assign is None or device not in op.assign.devices:
            continue
        if op.op == REDISTRIBUTE:
            x, y = op.inputs[0], op.outputs[0]
            assert x is not None
            if _is_identity(op.payload, env.get(x.id), _local_meta(x, device), _local_meta(y, device)):
                # nothing moves (e.g. a placement change on a mesh axis of size 1): no step, no copy, no sync
                env[y.id] = env[x.id]
                continue
            node = g.call_function(redistribute, (env.get(x.id),))
            node.meta.update(
                plan=op.payload,
                note=op.note,
                local=_local_meta(y, device),
                local_in=_local_meta(x, device),
                label=y.name,
            )
            env[y.id] = node
            continue
        rule, call = op.payload.rule, op.payload.call
        root = call.mesh.root
        coord = _coordinate(root, device)
        outs = [
            cached_local_shape_and_offset(o.shape, root.shape, o.root_placements, coord) for o in op.outputs
        ]
        ctx = LocalContext(
            device=device,
            coordinate=coord,
            in_shapes=[
                (m[0] if (m := _local_meta(x, device)) else None) if x is not None else None
                for x in call.inputs
            ],
            out_shapes=[s for s, _ in outs],
            out_offsets=[o for _, o in outs],
            torch_device=torch_device,
        )
        args, kwargs = rule.localize(call, ctx)
        args, kwargs = map_operands((tuple(args), dict(kwargs)), lambda o: env[o.id])
        if (
            torch_device is not None
            and torch_device.type != "cpu"
            and kwargs.get("device") is None
            and takes_device(call.op)
        ):
            kwargs = {**kwargs, "device": torch_device}
        custom = _has_custom_kernel(rule)
        if custom and kernel_needs_comm(call):
            node = g.call_function(comm_kernel, tuple(args), kwargs)
            node.meta.update(kernel=(rule, call, ctx), display=f"{target_name(call.op)}[rule kernel, comm]")
        else:
            target = _kernel_target(rule, call, ctx) if custom else call.op
            node = g.call_function(target, tuple(args), kwargs)
            if target is not call.op:
                node.meta["display"] = f"{target_name(call.op)}[rule kernel]"
        if _returns_sequence(call.op):
            node.meta.update(label=", ".join(o.name for o in op.outputs), multi=True)
            node.meta["local"] = tuple(_local_meta(o, device) for o in op.outputs)
            for i, o in enumerate(op.outputs):
                item = g.call_function(operator.getitem, (node, i))
                item.meta.update(local=_local_meta(o, device), label=o.name)
                env[o.id] = item
        else:
            node.meta.update(local=_local_meta(op.outputs[0], device), label=op.outputs[0].name)
            env[op.outputs[0].id] = node
    # one entry per tensor output, as a call's out ids (``None``: not held by this rank, e.g. another pipeline
    # stage's); plain values (a backward graph's ``None`` gradients) are no outputs of the program
    results = _distinct_outputs(g, tuple(env.get(o.id) for o in prop.outputs if isinstance(o, Operand)))
    g.output(results)
    g.lint()
    return _split(g, device, len(prop.inputs), tuple(in_meta), names)


def _is_identity(plan: Any, src: fx.Node | None, local_in: LocalMeta | None, local: LocalMeta | None) -> bool:
    """Whether a redistribute moves nothing on this rank: a plan without steps within one mesh, same local meta."""
    return (
        src is not None
        and not plan.steps
        and plan.src_mesh.root == plan.dst_mesh.root
        and local_in is not None
        and local_in == local
    )


def _distinct_outputs(g: fx.Graph, results: tuple[fx.Node | None, ...]) -> tuple[fx.Node | None, ...]:
    """Every output its own tensor: an output that is a program input (or another output), which an identity
    redistribute can make, is cloned, so later in-place ops on one blob never change another."""
    seen: set[fx.Node] = set()
    out: list[fx.Node | None] = []
    for r in results:
        if r is not None and (r.op == "placeholder" or r in seen):
            c = g.call_function(torch.ops.aten.clone.default, (r,))
            c.meta.update(local=r.meta.get("local"), label=r.meta.get("label"))
            r = c
        if r is not None:
            seen.add(r)
        out.append(r)
    return tuple(out)


def _split(
    g: fx.Graph, device: int, num_inputs: int, in_meta: tuple[LocalMeta | None, ...], names: dict[str, str]
) -> LocalProgram:
    """Cut the rank graph at its collectives into compute segments joined by value slots."""
    slot: dict[fx.Node, int] = {}
    next_slot = num_inputs
    steps: list[Step] = []
    current: list[fx.Node] = []
    output_node = next(n for n in g.nodes if n.op == "output")

    def new_slot(n: fx.Node) -> int:
        nonlocal next_slot
        slot[n] = next_slot
        next_slot += 1
        return slot[n]

    def close() -> None:
        if not current:
            return
        members = set(current)
        ins: list[fx.Node] = []
        for n in current:
            for a in n.all_input_nodes:
                if a not in members and a not in ins:
                    ins.append(a)
        outs = [n for n in current if any(u not in members for u in n.users)]
        sg = fx.Graph()
        mapping: dict[fx.Node, fx.Node] = {}
        for a in ins:
            mapping[a] = sg.placeholder(a.name)
        for n in current:
            mapping[n] = sg.node_copy(n, lambda x: mapping[x])
        sg.output(tuple(mapping[o] for o in outs))
        gm = fx.GraphModule(torch.nn.Module(), sg)
        out_meta = tuple(o.meta.get("local") or ((), torch.float32) for o in outs)
        steps.append(Segment(gm, tuple(slot[a] for a in ins), tuple(new_slot(o) for o in outs), out_meta))
        current.clear()

    for n in g.nodes:
        if n.op == "placeholder":
            slot[n] = len(slot)
        elif n.op == "output":
            break
        elif n.target is redistribute:
            close()
            src = n.args[0]
            assert src is None or isinstance(src, fx.Node)
            steps.append(
                CollectiveStep(
                    n.meta["plan"],
                    n.meta["note"],
                    slot[src] if src is not None else None,
                    new_slot(n),
                    n.meta.get("local_in"),
                    n.meta.get("local"),
                )
            )
        elif n.target is comm_kernel:
            close()
            rule, call, ctx = n.meta["kernel"]
            args, kwargs = _to_slots((n.args, dict(n.kwargs)), slot)
            steps.append(
                KernelStep(
                    rule,
                    call,
                    ctx,
                    tuple(args),
                    kwargs,
                    tuple(slot[a] for a in n.all_input_nodes),
                    new_slot(n),
                    n.meta.get("local"),
                    str(n.meta["display"]),
                )
            )
        else:
            current.append(n)
    close()
    results = output_node.args[0]
    assert isinstance(results, tuple)
    out_slots = tuple(slot[r] if isinstance(r, fx.Node) else None for r in results)
    _set_release(steps, set(s for s in out_slots if s is not None), num_inputs)
    return LocalProgram(device, g, steps, num_inputs, next_slot, out_slots, in_meta, names)


def _to_slots(value: Any, slot: dict[fx.Node, int]) -> Any:
    """``value`` with every FX node replaced by the :class:`SlotRef` of its slot (plain lists / tuples / dicts)."""
    if isinstance(value, fx.Node):
        return SlotRef(slot[value])
    if isinstance(value, (list, tuple)):
        items = [_to_slots(v, slot) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, dict):
        return {k: _to_slots(v, slot) for k, v in value.items()}
    return value


def _set_release(steps: list[Step], keep: set[int], num_inputs: int) -> None:
    """After each step, drop the slots nothing later reads (so intermediates die as early as in eager mode)."""
    last: dict[int, int] = {}
    for i, s in enumerate(steps):
        if isinstance(s, CollectiveStep):
            reads: tuple[int, ...] = (s.in_slot,) if s.in_slot is not None else ()
        else:
            reads = s.in_slots
        for r in reads:
            last[r] = i
    for i, s in enumerate(steps):
        s.release = tuple(r for r, at in last.items() if at == i and r not in keep)


# --- printing ------------------------------------------------------------------------------------------------------


def _meta_str(meta: Any) -> str:
    if meta is None:
        return "-"
    if (
        isinstance(meta, tuple)
        and meta
        and isinstance(meta[0], tuple)
        and len(meta[0]) == 2
        and isinstance(meta[0][1], torch.dtype)
    ):
        return "(" + ", ".join(_meta_str(m) for m in meta) + ")"
    shape, dtype = meta
    return f"{dtype_str(dtype)}[{', '.join(map(str, shape))}]"


def _label(a: Any) -> str:
    if isinstance(a, fx.Node):
        return str(a.meta.get("label", f"%{a.name}"))
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_label(x) for x in a) + "]"
    return format_value(a)


def format_local_program(g: fx.Graph) -> str:
    """One line per node, named like the LogicalGraph's operands, local shapes after ``->``, collectives with
    their plan: the golden form."""
    lines = []
    for node in g.nodes:
        meta = node.meta.get("local")
        label = node.meta.get("label", f"%{node.name}")
        if node.op == "placeholder":
            lines.append(f"{label} = input() -> {_meta_str(meta)}")
        elif node.op == "output":
            lines.append(f"return {_label(node.args[0])}")
        elif node.target is redistribute:
            lines.append(
                f"{label} = redistribute({_label(node.args[0])}) -> {_meta_str(meta)}  # {node.meta['note']}"
            )
        elif node.target is operator.getitem:
            continue  # shown on the line of the op that returns several tensors
        else:
            parts = [_label(a) for a in node.args]
            parts += [f"{k}={_label(v)}" for k, v in node.kwargs.items()]
            name = node.meta.get("display") or target_name(node.target)
            lines.append(f"{label} = {name}({', '.join(parts)}) -> {_meta_str(meta)}")
    return "\n".join(lines)
