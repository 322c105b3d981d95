"""``cat``: local signatures, and a communicating one that keeps the cat dim sharded.

**Idle inputs stay in place.** An input that adds no rows — a legacy 1-d empty tensor (``torch.tensor([])``, which
torch skips) or one of the output's rank with length 0 along the cat dim (an empty KV cache ``[B, H, 0, D]``) — keeps
its own placements in every signature (the slot is pinned) and is left out of the kernel's arithmetic (the result is
cast to the promoted dtype it would have given). So an empty past never costs a redistribute and never changes the
decision: ``cat([empty, k])`` keeps ``k``'s placements, whatever they are. (When every input is idle, none is.)

Signatures (one mesh axis; over the kept inputs):

- every input ``S(d)`` -> ``S(d)`` for each dim ``d`` other than the cat dim (the inputs share those sizes, so
  their chunks line up): local;
- every input the same ``P`` -> ``P`` (concatenation is linear): local;
- **along the sharded cat dim**: every input ``S(dim)`` -> ``S(dim)``. Offered when there is one input (the cat is
  the identity) or when, on some mesh axis, every input already is ``S(dim)``: then the output's chunks are cut
  from the inputs' chunks by one point-to-point exchange among the ranks of the axes that shard the cat dim (each
  rank sends each peer the rows of the peer's output chunk it holds), which is cheaper than gathering the inputs and
  keeps the work divided. This is what keeps the joint text + image sequence of FLUX / SD3 sequence-sharded into
  their attention, so a ring context-parallel axis really rings (``context_parallel.py``). With a replicated peer
  (a decode step's new token next to a sequence-sharded KV cache) the signature is not offered: the matcher picks
  among the local ones.

The communicating kernel is exact for uneven and nested shards (positions come from ``local_shape_and_offset``).
The other ``cat`` calls run the op itself.

**A growing cat plans once.** A KV cache grows by ``cat([past, new], dim=-2)`` every decoded token, so the plan
cache (keyed by exact shapes) misses every token, and each miss runs the op on meta tensors (torch's Python meta
``cat``, ~0.4 ms) and the matcher. :meth:`CatRule.plan` keeps the *decision* (the per-axis match) under a key with the
cat-dim lengths bucketed (``min(length, max(2, largest mesh axis))``: what the matcher's empty-shard test can see)
and derives the output's metadata by arithmetic. A decision is kept only when it is independent of those lengths:
on every axis the inputs already match, or the chosen redistributes are all free (``R -> S`` slices). Then every
other candidate's cost is zero at every length or positive at every length, and the tie-breaks (empty shards, moves,
partial outputs, order) see only the key, so the matcher would choose the same at any length. The same key is
the rule's growth key (:meth:`CatRule.growth_key`, ``placement_rules/growth.py``): the eager fast path derives a
growing cat's template from it without planning at all (``device/fastpath_grow.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.config import RedistributePolicy, get_config
from torch_dtorch.graph import AssignInfo, Operand, OperatorCost, TensorMeta
from torch_dtorch.graph.operand import contiguous_strides
from torch_dtorch.ops.cost import traffic_cost
from torch_dtorch.placement import Placement, Placements, Replicate, Shard, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.comm import device_comm, exchange, register_comm_kernel
from torch_dtorch.placement_rules.families.view import distinct_partials, norm_dim
from torch_dtorch.placement_rules.growth import bucket, free_decision, is_contiguous
from torch_dtorch.placement_rules.matcher import Match
from torch_dtorch.placement_rules.rule import OpPlan, OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["CAT_TAG", "cat_comm_axes", "decision_stats", "skipped_inputs"]

aten = torch.ops.aten
_R = Replicate()
#: point-to-point tag of the communicating cat
CAT_TAG = 0x6361


def _is_legacy_empty(x: Operand | None) -> bool:
    """torch's legacy rule: a 1-d tensor with no elements takes no part in ``cat``."""
    return x is not None and x.ndim == 1 and x.shape[0] == 0


def _cat_ndim(call: OpCall) -> int:
    """The output's rank, from the inputs (the first that is not a legacy empty; 1 when all are)."""
    for x in call.inputs:
        if x is not None and not _is_legacy_empty(x):
            return x.ndim
    return 1


def skipped_inputs(call: OpCall) -> list[bool]:
    """Per input slot: idle — a legacy 1-d empty tensor, or an input of the output's rank with no rows along the cat
    dim — unless every input is idle. Idle inputs keep their placements and take no part in the arithmetic."""
    nd = _cat_ndim(call)
    dim = norm_dim(call.arg("dim"), nd) if nd else None
    idle = [
        x is not None and (_is_legacy_empty(x) or (dim is not None and x.ndim == nd and x.shape[dim] == 0))
        for x in call.inputs
    ]
    return [False] * len(idle) if all(idle) else idle


def _dim(call: OpCall) -> int:
    return norm_dim(call.arg("dim"), call.out_ndim)


def _shard_dim(p: Placement | None, ndim: int) -> int | None:
    return p.dim % ndim if type(p) is Shard and ndim else None


def cat_comm_axes(call: OpCall) -> list[int]:
    """Mesh axes (of size > 1) on which the call's kept inputs are all ``S(dim)``: the cat exchanges rows over
    them. Empty when one input is kept (the cat is the identity there)."""
    mesh = call.mesh
    if mesh is None or call.out_ndim == 0:
        return []
    keep = [i for i, s in enumerate(skipped_inputs(call)) if not s]
    if len(keep) < 2:
        return []
    dim, nd = _dim(call), call.out_ndim
    axes = []
    for a in range(mesh.ndim):
        pls = [call.placements[i] for i in keep]
        if mesh.shape[a] > 1 and all(pl is not None and _shard_dim(pl[a], nd) == dim for pl in pls):
            axes.append(a)
    return axes


def _signatures(call: OpCall) -> list[PlacementSignature]:
    skipped = skipped_inputs(call)
    nd = call.out_ndim
    kept = [x for x, s in zip(call.inputs, skipped, strict=True) if not s]
    if any(x is None or x.ndim != nd for x in kept) or nd == 0:
        return _joined(call, skipped, [])
    dim = _dim(call)
    pairs = [d for d in range(nd) if d != dim]
    if len(kept) == 1 or _all_shard_on_some_axis(call, skipped, dim):
        pairs.append(dim)
    return _joined(call, skipped, pairs)


def _all_shard_on_some_axis(call: OpCall, skipped: Sequence[bool], dim: int) -> bool:
    mesh = call.mesh
    if mesh is None:
        return False
    nd = call.out_ndim
    pls = [pl for pl, s in zip(call.placements, skipped, strict=True) if not s]
    return any(all(pl is not None and _shard_dim(pl[a], nd) == dim for pl in pls) for a in range(mesh.ndim))


#: at most this many idle-placement combinations per signature (beyond: idle inputs are offered Replicate too)
_MAX_IDLE_COMBOS = 16


def _own_placements(call: OpCall, skipped: Sequence[bool]) -> list[list[Placement | None]]:
    """Per slot: an idle input's distinct placements over the mesh axes; ``[None]`` for a kept slot."""
    out: list[list[Placement | None]] = []
    for pl, s in zip(call.placements, skipped, strict=True):
        own: list[Placement | None] = [None]
        if s:
            own = []
            for p in pl or (_R,):
                if p not in own:
                    own.append(p)
        out.append(own)
    return out


def _idle_overflow(call: OpCall, skipped: Sequence[bool]) -> bool:
    return math.prod(len(o) for o in _own_placements(call, skipped)) > _MAX_IDLE_COMBOS


def _idle_choices(call: OpCall, skipped: Sequence[bool]) -> list[list[Placement | None]]:
    """Per combination: the placement of every slot that is idle (``None`` for kept slots). Each idle input is
    offered its own distinct placements over the mesh axes (an axis's exact match is one of them); beyond
    ``_MAX_IDLE_COMBOS`` combinations, Replicate only (and they are not pinned)."""
    if _idle_overflow(call, skipped):
        return [[_R if s else None for s in skipped]]
    combos: list[list[Placement | None]] = [[]]
    for own in _own_placements(call, skipped):
        combos = [[*c, p] for c in combos for p in own]
    return combos


def _joined(call: OpCall, skipped: Sequence[bool], dims: Sequence[int]) -> list[PlacementSignature]:
    """Kept inputs ``S(d)`` -> ``S(d)`` per dim; kept inputs the same ``P`` -> ``P``; kept inputs ``R`` -> ``R``;
    idle inputs in their own placements (every combination of them)."""
    outs: list[Placement] = [Shard(d) for d in dims]
    for pl, s in zip(call.placements, skipped, strict=True):
        if not s:
            outs += [p for p in distinct_partials(pl) if p not in outs]
    if any(skipped):
        outs.append(_R)  # the all-Replicate signature with the idle inputs in place
    sigs = []
    for p in outs:
        for idle in _idle_choices(call, skipped):
            sigs.append(sig([p if q is None else q for q in idle], p))
    return sigs


def _kept_placements(call: OpCall) -> Placements:
    for pl, s in zip(call.placements, skipped_inputs(call), strict=True):
        if not s and pl is not None:
            return pl
    raise AssertionError("cat: no kept input")


def _comm_cat(call: OpCall, ctx: LocalContext, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The local chunk of the output when the cat dim is sharded on ``cat_comm_axes(call)``: every rank of the
    group (the ranks that differ only on those axes) sends every peer the rows of the peer's output chunk it holds;
    the receiver orders the pieces by global position."""
    mesh = call.mesh
    assert mesh is not None
    ms, coord, dim = tuple(mesh.shape), tuple(ctx.coordinate), _dim(call)
    axes = cat_comm_axes(call)
    keep = [i for i, s in enumerate(skipped_inputs(call)) if not s]
    ops = [call.inputs[i] for i in keep]
    locals_ = [tensors[i] for i in keep]
    pls = [call.placements[i] for i in keep]
    out_pl = _kept_placements(call)
    out_shape = tuple(call.out_meta[0].shape)
    group = [coord]
    for a in axes:
        group = [(*c[:a], i, *c[a + 1 :]) for c in group for i in range(ms[a])]
    group.sort()
    me = group.index(coord)
    bases, acc = [], 0
    for x in ops:
        assert x is not None
        bases.append(acc)
        acc += x.shape[dim]

    def rows(c: tuple[int, ...]) -> list[tuple[int, int]]:
        """Per kept input: (start in the output, length) of the rows member ``c`` holds."""
        out = []
        for x, pl, base in zip(ops, pls, bases, strict=True):
            assert x is not None and pl is not None
            s, o = local_shape_and_offset(x.shape, ms, pl, c)
            out.append((base + o[dim], s[dim]))
        return out

    def out_range(c: tuple[int, ...]) -> tuple[int, int]:
        s, o = local_shape_and_offset(out_shape, ms, out_pl, c)
        return o[dim], o[dim] + s[dim]

    def segments(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int, int]]:
        """(input, first local row, length, output position) of what ``src`` sends ``dst``."""
        lo, hi = out_range(dst)
        segs = []
        for i, (start, length) in enumerate(rows(src)):
            a, b = max(lo, start), min(hi, start + length)
            if b > a:
                segs.append((i, a - start, b - a, a))
        return segs

    pieces = []
    for dst in group:
        segs = segments(coord, dst)
        parts = [locals_[i].narrow(dim, r, n) for i, r, n, _ in segs]
        pieces.append(torch.cat(parts, dim) if parts else _empty_rows(locals_[0], dim))
    comm = device_comm(ctx, f"{call.op} along a sharded dim")
    got = exchange(comm, [int(mesh.mesh[c]) for c in group], me, pieces, tag=CAT_TAG)
    placed: list[tuple[int, torch.Tensor]] = []
    for src, t in zip(group, got, strict=True):
        segs = segments(src, coord)
        parts = t.split([s[2] for s in segs], dim) if segs else []
        placed += [(seg[3], part) for seg, part in zip(segs, parts, strict=True)]
    placed.sort(key=lambda e: e[0])
    if not placed:
        return _empty_rows(locals_[0], dim)
    return torch.cat([t for _, t in placed], dim)


def _empty_rows(like: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = 0
    return like.new_empty(shape)


#: decisions kept by :meth:`CatRule.plan`, and its hits / misses (for tests and benchmarks)
_DECISIONS: dict[tuple[Any, ...], tuple[Match, torch.dtype, AssignInfo]] = {}
_DECISIONS_SIZE = 4096
decision_stats = {"hit": 0, "miss": 0, "kept": 0}


class _Growth:
    """A cat call's decision key and what a kept decision's plan needs (the output shape), from one pass over the
    inputs; ``key`` is ``None`` when the decision cache does not handle the call (symbolic sizes, unknown
    strides, inputs of different ranks)."""

    __slots__ = ("key", "out_shape", "bytes_read")

    def __init__(self, call: OpCall) -> None:
        self.key: tuple[Any, ...] | None = None
        self.out_shape: list[int] = []
        self.bytes_read = 0
        mesh = call.mesh
        dim_arg = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", 0)
        if mesh is None or not call.inputs or type(dim_arg) is not int:
            return
        nd = _cat_ndim(call)
        if nd == 0:
            return
        dim = norm_dim(dim_arg, nd)
        slots: list[Any] = []
        total, some_kept = 0, False
        for x, pl in zip(call.inputs, call.placements, strict=True):
            if x is None:
                return
            shape, stride = x.shape, x.stride
            if len(shape) == 1 and shape[0] == 0 and nd != 1:  # legacy empty
                slots.append((x.dtype, pl))
                continue
            if stride is None or len(shape) != nd or any(type(n) is not int for n in shape):
                return
            n = shape[dim]
            if n:
                some_kept = True
            if not self.out_shape:
                self.out_shape = list(shape)
            total += n
            self.bytes_read += math.prod(shape) * x.dtype.itemsize
            bucketed = (*shape[:dim], bucket(n, mesh), *shape[dim + 1 :])
            slots.append((bucketed, None if is_contiguous(shape, stride) else stride, x.dtype, pl))
        if not self.out_shape:
            return
        self.out_shape[dim] = total
        # the idle pattern is in the key: lengths of 0 are kept exactly by the buckets, ``some_kept`` says whether
        # the idle rule applies at all
        self.key = (mesh, dim, tuple(slots), some_kept)


class CatRule(OpRule):
    """``cat`` (see the module docstring): the op itself, or the exchange when the call communicates."""

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        return _signatures(call)

    def pinned_for(self, call: OpCall) -> Sequence[int]:
        """Idle inputs keep their placements (unless they had too many combinations to offer them all)."""
        idle = skipped_inputs(call)
        if _idle_overflow(call, idle):
            return []
        return [i for i, s in enumerate(idle) if s]

    def plan(
        self,
        call: OpCall,
        *,
        policy: RedistributePolicy | None = None,
        prefer_outputs: tuple[Placements, ...] | None = None,
    ) -> OpPlan:
        """:meth:`OpRule.plan`, with a growing cat's decision kept across lengths (module docstring)."""
        policy = policy if policy is not None else get_config().redistribute
        growth = _Growth(call)
        key = None if growth.key is None else (growth.key, policy, prefer_outputs)
        if key is not None:
            kept = _DECISIONS.get(key)
            if kept is not None:
                decision_stats["hit"] += 1
                m, dtype, assign = kept
                shape = tuple(growth.out_shape)
                meta = TensorMeta(shape, dtype, contiguous_strides(shape))
                call.out_meta = [meta]
                written = math.prod(shape) * dtype.itemsize
                return OpPlan(call.out_meta, m, assign, OperatorCost(0, growth.bytes_read, written))
        decision_stats["miss"] += 1
        plan = super().plan(call, policy=policy, prefer_outputs=prefer_outputs)
        if key is not None and free_decision(call, plan.match):
            meta = plan.out_meta[0]
            if meta.stride is not None and is_contiguous(meta.shape, meta.stride):
                if len(_DECISIONS) >= _DECISIONS_SIZE:
                    _DECISIONS.clear()
                _DECISIONS[key] = (plan.match, meta.dtype, plan.assign)
                decision_stats["kept"] += 1
        return plan

    def growth_key(self, call: OpCall) -> Any:
        """The decision cache's key (module docstring): the cat-dim lengths bucketed, the rest exact."""
        return _Growth(call).key

    def grown_meta(self, call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
        """A contiguous result of the summed lengths (only where the kept one was contiguous: torch keeps an
        input memory format otherwise)."""
        growth = _Growth(call)
        meta = kept[0]
        if growth.key is None or meta.stride is None or not is_contiguous(meta.shape, meta.stride):
            return None
        shape = tuple(growth.out_shape)
        return [TensorMeta(shape, meta.dtype, contiguous_strides(shape))]

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if cat_comm_axes(call):
            return _comm_cat(call, ctx, args[0])
        idle = skipped_inputs(call)
        if any(
            idle
        ):  # idle inputs may be placed unlike the output: left out, the result cast as torch's would be
            kept = [t for t, s in zip(args[0], idle, strict=True) if not s]
            out = call.op(kept, *args[1:], **kwargs)
            dtype = call.out_meta[0].dtype
            return out if out.dtype == dtype else out.to(dtype)
        return call.op(*args, **kwargs)

    def may_run_op_as_is(self, op: Any) -> bool:
        return "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        return "kernel" not in vars(self) and not cat_comm_axes(call)

    def cost(self, call: OpCall) -> OperatorCost:
        return traffic_cost(call.inputs, call.out_meta)


register_rule(aten.cat.default, family="shape")(CatRule)
register_comm_kernel(aten.cat.default, lambda call: bool(cat_comm_axes(call)))
