"""Unbound Replicate operands: dtorch tensors made without a mesh bind to the mesh of their first consumer.

``torch.arange(n, device=x.device)`` inside model code, ``torch.zeros(..., device="dtorch")`` and
``cpu_tensor.to("dtorch")`` know no mesh. They become *unbound* operands that remember how to make themselves
(the factory call, or the CPU value to upload); the first op that uses one next to a bound operand materializes it,
Replicate, on that operand's mesh (once per mesh: pipeline stages each get their copy). Ops whose inputs are all
unbound bind to the innermost ``with mesh:``, else to the mesh of the most recent op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch.errors import DTorchError
from torch_dtorch.executor.fast import FastPlan
from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.mesh import DeviceMesh, current_mesh
from torch_dtorch.placement import Replicate
from torch_dtorch.placement_rules.rule import add_rule_listener, const_key

if TYPE_CHECKING:
    from torch_dtorch.device.state import Session

__all__ = [
    "Deferred",
    "NoMeshError",
    "bind",
    "defer_factory",
    "defer_upload",
    "factory_plan",
    "fallback_mesh",
    "host_value",
    "move_eager",
    "note_eager",
    "record_factory",
    "release_uploads",
    "watch",
]


class NoMeshError(DTorchError, RuntimeError):
    """A dtorch tensor made without a mesh was used where no mesh can be inferred."""


@dataclass
class Deferred:
    kind: str  # "factory" | "upload"
    op: Any = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    value: torch.Tensor | None = None
    bound: dict[DeviceMesh, Operand] = field(default_factory=dict)
    #: called when the factory is bound on a mesh (``first``: its first binding); see :func:`watch`
    on_bind: Callable[[DeviceMesh, bool], None] | None = None


_DEFERRED: dict[int, Deferred] = {}


def _unbound(rt: Session, meta: TensorMeta, deferred: Deferred) -> Operand:
    operand = rt.executor.input(meta.shape, None, dtype=meta.dtype)
    _DEFERRED[operand.id] = deferred
    return operand


def defer_factory(
    rt: Session, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], meta: TensorMeta
) -> Operand:
    return _unbound(rt, meta, Deferred("factory", op, args, dict(kwargs)))


def defer_upload(rt: Session, value: torch.Tensor) -> Operand:
    value = value.detach()
    return _unbound(rt, TensorMeta.of(value), Deferred("upload", value=value))


def host_value(x: Operand) -> torch.Tensor | None:
    """The value of an unbound operand computed on the controller's CPU (``None``: not an unbound operand)."""
    deferred = _DEFERRED.get(x.id)
    if deferred is None:
        return None
    if deferred.kind == "upload":
        return deferred.value
    return deferred.op(*deferred.args, **{**deferred.kwargs, "device": torch.device("cpu")})


def watch(x: Operand, on_bind: Callable[[DeviceMesh, bool], None]) -> None:
    """Call ``on_bind(mesh, first)`` whenever the deferred factory ``x`` is bound on a mesh (the eager fast path of
    factories learns where a call's result goes: :mod:`torch_dtorch.device.fastpath_factory`)."""
    deferred = _DEFERRED.get(x.id)
    if deferred is not None and deferred.kind == "factory":
        deferred.on_bind = on_bind


def forget(operand: Operand) -> None:
    _DEFERRED.pop(operand.id, None)


def release_uploads(rt: Session, unbound: list[Operand], keep: list[Operand]) -> None:
    """Drop the unbound operands a call made for its plain CPU scalars (0-d tensors, which no dtorch tensor stands
    for) and free their bound copies after the call, unless an output views one of them (``keep``: the outputs).
    Without this every ``x * torch.tensor(t)`` left a blob on every worker."""
    for x in unbound:
        deferred = _DEFERRED.pop(x.id, None)
        if deferred is None:
            continue
        for y in deferred.bound.values():
            if not any(o.base is y or o is y for o in keep):
                rt.executor.free(y)


#: operand id -> callback, of the live factory results the fast path bound at once on the mesh their call's
#: earlier results went to (:mod:`torch_dtorch.device.fastpath_factory`): an op that meets one next to inputs on
#: another mesh moves it there (:func:`move_eager`), as binding a deferred factory would have. An entry goes when
#: its tensor dies (the free callback of ``device/state.py`` pops it); the bound is a guard against leaks only
_EAGER: dict[int, Callable[[], None]] = {}
_MAX_EAGER = 1 << 16


def _MOVED() -> None:
    """The callback of an :data:`_EAGER` entry that was moved once already (its key was told then)."""


def note_eager(x: Operand, on_moved: Callable[[], None]) -> None:
    """``x`` was bound at once where a deferred factory would have been bound by its consumer; ``on_moved()`` is
    called if a consumer on another mesh meets it."""
    eager = _EAGER
    if len(eager) >= _MAX_EAGER:
        del eager[next(iter(eager))]
    eager[x.id] = on_moved


def move_eager(rt: Session, bound: list[Operand]) -> dict[int, Operand]:
    """For an op whose bound inputs live on several meshes: the factory results among them that the fast path
    bound at once (:func:`note_eager`) moved to the mesh of the other inputs (operand id -> the moved copy, which
    the caller frees after the op); empty when that does not make one mesh (the full path raises its error)."""
    eager = [x for x in bound if x.id in _EAGER]
    others = [x for x in bound if x.id not in _EAGER]
    if not eager or not others or len({x.mesh.root for x in others}) != 1:  # type: ignore[union-attr]
        return {}
    mesh = others[0].mesh
    assert mesh is not None
    moved: dict[int, Operand] = {}
    for x in eager:
        if x.mesh.root is not mesh.root:  # type: ignore[union-attr]
            # the entry stays: autograd may have saved ``x`` itself for the backward, which meets it again
            on_moved = _EAGER[x.id]
            if on_moved is not _MOVED:
                _EAGER[x.id] = _MOVED
                on_moved()
            moved[x.id] = rt.executor.redistribute(x, [Replicate()] * mesh.ndim, mesh)
    return moved


def fallback_mesh(rt: Session, what: str) -> DeviceMesh:
    mesh = current_mesh() or rt.last_mesh
    if mesh is None:
        raise NoMeshError(
            f"{what}: this dtorch tensor was created without a mesh and nothing tells which mesh it belongs to; "
            "create it inside `with mesh:` or with device_mesh=/placements=, or use it next to a distributed tensor"
        )
    return mesh


def bind(rt: Session, x: Operand, mesh: DeviceMesh) -> Operand:
    """The operand ``x`` materialized (Replicate) on ``mesh``; ``x`` itself when it is already bound."""
    if x.mesh is not None:
        return x
    deferred = _DEFERRED.get(x.id)
    if deferred is None:
        raise NoMeshError(f"internal: unbound operand {x.name} has no recipe")
    hit = deferred.bound.get(mesh)
    if hit is not None:
        return hit
    ex = rt.executor
    placements = [Replicate()] * mesh.ndim
    if deferred.kind == "factory":
        out = record_factory(ex, deferred.op, deferred.args, deferred.kwargs, mesh, placements=placements)
        if deferred.on_bind is not None:
            deferred.on_bind(mesh, not deferred.bound)
    else:
        assert deferred.value is not None
        out = ex.constructor.input(tuple(x.shape), mesh, placements, dtype=x.dtype)
        ex.upload(out, deferred.value)
    deferred.bound[mesh] = out
    return out


#: ``(op, constants, mesh) -> FastPlan`` of the factories bound so far: model code makes the same
#: ``torch.arange(n, device=x.device)`` every step, and its binding replays the plan instead of planning again
_FACTORY_PLANS: dict[tuple[Any, ...], FastPlan] = {}
_MAX_FACTORY_PLANS = 4096


def _factory_key(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh, placements: Any
) -> tuple[Any, ...]:
    """The key of :data:`_FACTORY_PLANS` (``TypeError``: an unhashable constant)."""
    pl = None if placements is None else tuple(placements)
    key = (op, const_key(args), const_key(kwargs), mesh, pl)
    hash(key)
    return key


def factory_plan(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], mesh: DeviceMesh, *, replicate: bool
) -> FastPlan | None:
    """The plan :func:`record_factory` keeps for ``op(*args, **kwargs)`` on ``mesh`` (``replicate``: in Replicate,
    as a deferred factory binds; else in the rule's placements); ``None``: none."""
    placements = [Replicate()] * mesh.ndim if replicate else None
    try:
        return _FACTORY_PLANS.get(_factory_key(op, args, kwargs, mesh, placements))
    except TypeError:
        return None


def record_factory(
    ex: Any,
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mesh: DeviceMesh,
    *,
    placements: list[Any] | None = None,
) -> Operand:
    """``op(*args, **kwargs)`` (a factory: no tensor inputs) recorded on ``mesh`` in ``placements`` (default: the
    rule's, Replicate): planned once per op, constants, mesh and placements, then replayed like a fast-path hit."""
    try:
        key: tuple[Any, ...] | None = _factory_key(op, args, kwargs, mesh, placements)
        plan = _FACTORY_PLANS.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable constant
        key, plan = None, None
    if plan is not None:
        return ex.record_fast(plan, args, [])[0]
    constructor = ex.constructor
    before = constructor.last_call
    if placements is None:
        out = ex.call(op, *args, device_mesh=mesh, **kwargs)
    else:
        out = ex.call(op, *args, device_mesh=mesh, placements=[placements], **kwargs)
    last = constructor.last_call
    if key is None or last is None or last is before or last.op is not op or not isinstance(out, Operand):
        return out
    if len(last.outputs) == 1 and last.outputs[0] is out and not last.moved and not last.call.inputs:
        if len(_FACTORY_PLANS) >= _MAX_FACTORY_PLANS:
            _FACTORY_PLANS.clear()
        out_specs = [(last.plan.out_meta[0], out.mesh, out.placements)]
        _FACTORY_PLANS[key] = FastPlan(
            last.rule, last.call, [], out_specs, last.plan.assign, last.plan.cost, ()
        )
    return out


def _rule_changed(op: Any) -> None:
    for key in [k for k in _FACTORY_PLANS if k[0] is op]:
        del _FACTORY_PLANS[key]


add_rule_listener(_rule_changed)
