"""Shape-generic templates: a call whose layouts the fast path has never seen, but whose op's rule kept a
decision for calls of the same *growth key*, gets its template derived instead of planned in full.

Decode meets new lengths every token: the KV cache ``cat``, the ``[:, -1:]`` slice of the growing ``input_ids``,
SDPA over the grown cache. Their templates (keyed by exact layouts) miss every token although the rule's decision —
which signature each mesh axis takes, so the input targets and output placements — is the one of the last token.
When the full path records a template for an op whose rule has a growth key (:meth:`OpRule.growth_key`,
``placement_rules/growth.py``) and the decision is *free* (:func:`~torch_dtorch.placement_rules.growth.free_decision`:
no move that costs bytes, so no length can tip the matcher), :func:`keep` stores the decision under

    (the rule's growth key, the call's constants, each input's (mesh, placements, dtype), the redistribute policy)

and a later exact miss with an equal key is derived (:func:`derive`): output metadata by the rule's arithmetic
(:meth:`OpRule.grown_meta`), cost by the rule, redistributes of the inputs planned for their actual shapes (uneven
shards included), output placements and meshes as kept. The derived template is stored under its exact key, so
the next call at that length is a plain hit (and the native kernel learns it); views keep exact keys too — a view's
output carries its input's strides, which the derived metadata reproduces from the actual input.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from torch_dtorch.config import RedistributePolicy, get_config
from torch_dtorch.device.fastpath_template import Template, TemplateOwner
from torch_dtorch.errors import PlacementError
from torch_dtorch.graph import AssignInfo, Operand, TensorMeta
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements
from torch_dtorch.placement_rules import OpCall, OpRule
from torch_dtorch.placement_rules.growth import free_decision
from torch_dtorch.placement_rules.matcher import Match
from torch_dtorch.placement_rules.rule import OpPlan

__all__ = ["Kept", "derive", "keep", "stats"]

#: decisions kept / templates derived from them (for tests and benchmarks)
stats = {"kept": 0, "derived": 0}

_KEPT_PER_OP = 1024


class Kept(NamedTuple):
    """A free decision of one growth key: the match, the assignment, and the output metadata and placements."""

    match: Match
    assign: AssignInfo
    out_meta: tuple[TensorMeta, ...]
    out_places: tuple[tuple[DeviceMesh | None, Placements], ...]


def _policy(rt: Any) -> RedistributePolicy:
    policy = rt.executor.constructor.policy
    return policy if policy is not None else get_config().redistribute


def _growth_key(rule: OpRule, call: OpCall, key: tuple[Any, ...], rt: Any) -> tuple[Any, ...] | None:
    """The grown-template key of ``call`` (module docstring); ``key`` is the exact fast-path key (its ints are the
    input layouts, everything else the constants). ``None``: the rule has no growth key for this call."""
    g = rule.growth_key(call)
    if g is None:
        return None
    consts = tuple(k for k in key if type(k) is not int)
    ins = tuple(None if x is None else (x.mesh, x.placements, x.dtype) for x in call.inputs)
    return (g, consts, ins, _policy(rt))


def keep(
    grown: dict[tuple[Any, ...], Kept],
    rt: Any,
    rule: OpRule,
    call: OpCall,
    plan: OpPlan,
    outputs: list[Operand],
    key: tuple[Any, ...],
) -> None:
    """After the full path planned ``call`` (and a template was recorded under ``key``): keep its decision when
    the rule has a growth key for it and the decision is free."""
    if call.mesh is None or not free_decision(call, plan.match):
        return
    gkey = _growth_key(rule, call, key, rt)
    if gkey is None:
        return
    if len(grown) >= _KEPT_PER_OP:
        grown.clear()
    grown[gkey] = Kept(
        plan.match, plan.assign, tuple(plan.out_meta), tuple((o.mesh, o.placements) for o in outputs)
    )
    stats["kept"] += 1


def derive(
    grown: dict[tuple[Any, ...], Kept],
    rt: Any,
    rule: OpRule,
    op: Any,
    targs: list[Any],
    kwargs: dict[str, Any],
    key: tuple[Any, ...],
    owner: TemplateOwner,
) -> Template | None:
    """The template of a call whose exact key missed, derived from a kept decision (``None``: none applies)."""
    try:
        call = OpCall.make(op, tuple(targs), kwargs)
    except PlacementError:  # inputs on several meshes: the full path decides (and words the error)
        return None
    if call.mesh is None:
        return None
    gkey = _growth_key(rule, call, key, rt)
    kept = None if gkey is None else grown.get(gkey)
    if kept is None:
        return None
    metas = rule.grown_meta(call, kept.out_meta)
    if metas is None or len(metas) != len(kept.out_meta):
        return None
    call.out_meta = metas
    plan = OpPlan(metas, kept.match, kept.assign, rule.cost(call))
    first = next(x for x in call.inputs if x is not None)
    stats["derived"] += 1
    return Template(
        rule,
        call,
        op_plan=plan,
        moved=kept.match.needs_redistribute(call),
        out_specs=[(m, mesh, pl) for m, (mesh, pl) in zip(metas, kept.out_places, strict=True)],
        mesh=first.mesh,
        slot_pos=owner.slot_pos,
        owner=owner,
        targs=targs,
    )
