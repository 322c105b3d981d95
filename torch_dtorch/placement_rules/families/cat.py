"""``cat``: local signatures, and a communicating one that keeps the cat dim sharded.

Signatures (one mesh axis; legacy 1-d empty inputs — ``torch.tensor([])`` — are skipped as torch skips them: they
take ``R`` in every signature and are left out of the kernel's arithmetic):

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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.graph import Operand, OperatorCost
from torch_dtorch.ops.cost import traffic_cost
from torch_dtorch.placement import Placement, Placements, Replicate, Shard, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.comm import device_comm, exchange, register_comm_kernel
from torch_dtorch.placement_rules.families.view import distinct_partials, norm_dim
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["CAT_TAG", "cat_comm_axes", "skipped_inputs"]

aten = torch.ops.aten
_R = Replicate()
#: point-to-point tag of the communicating cat
CAT_TAG = 0x6361


def _is_skipped(x: Operand | None) -> bool:
    """torch's legacy rule: a 1-d tensor with no elements takes no part in ``cat``."""
    return x is not None and x.ndim == 1 and x.shape[0] == 0


def skipped_inputs(call: OpCall) -> list[bool]:
    """Per input slot: skipped by ``cat`` (a legacy 1-d empty tensor), unless every input is one."""
    skipped = [_is_skipped(x) for x in call.inputs]
    return [False] * len(skipped) if all(skipped) else skipped


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


def _joined(call: OpCall, skipped: Sequence[bool], dims: Sequence[int]) -> list[PlacementSignature]:
    """Kept inputs ``S(d)`` -> ``S(d)`` per dim; kept inputs the same ``P`` -> ``P``; skipped inputs ``R``."""

    def each(p: Placement) -> list[Placement]:
        return [_R if s else p for s in skipped]

    sigs = [sig(each(Shard(d)), Shard(d)) for d in dims]
    partials: list[Placement] = []
    for pl, s in zip(call.placements, skipped, strict=True):
        if not s:
            partials += [p for p in distinct_partials(pl) if p not in partials]
    return sigs + [sig(each(p), p) for p in partials]


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


class CatRule(OpRule):
    """``cat`` (see the module docstring): the op itself, or the exchange when the call communicates."""

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        return _signatures(call)

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if cat_comm_axes(call):
            return _comm_cat(call, ctx, args[0])
        return call.op(*args, **kwargs)

    def may_run_op_as_is(self, op: Any) -> bool:
        return "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        return "kernel" not in vars(self) and not cat_comm_axes(call)

    def cost(self, call: OpCall) -> OperatorCost:
        return traffic_cost(call.inputs, call.out_meta)


register_rule(aten.cat.default, family="shape")(CatRule)
register_comm_kernel(aten.cat.default, lambda call: bool(cat_comm_axes(call)))
