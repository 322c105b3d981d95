"""View family: ops whose output aliases input 0 (``view_of=0``); every overload here is intercepted so that it
reaches the ``dtorch`` key whole instead of as an anonymous ``as_strided``.

Signatures (one mesh axis; ``P`` is any Partial the input carries, outputs of multi-output ops all get the same
placement):
- every view: ``P -> P`` (a view only relabels elements, so it commutes with the reduction) and ``R -> R``.
- dim-relabelling views — ``permute``, ``transpose``, ``t``, ``movedim``, ``unsqueeze``, ``squeeze``, ``alias``,
  ``detach``: ``S(d) -> S(d')`` where ``d'`` is where input dim ``d`` lands. ``squeeze`` removes only dims of global
  size 1 (a shard may be 1 long locally), and a squeezed dim is never sharded.
- ``expand``: ``S(d) -> S(d + new leading dims)`` for dims that are not broadcast; sizes are localized.
- ``slice``, ``narrow``, ``select``, ``split``, ``split_with_sizes``, ``chunk``, ``unbind``: ``S(d) -> S(d')`` for
  every dim except the one sliced (a full ``slice`` along a sharded dim keeps it). Slicing a sharded dim is not
  local: no signature, so the matcher moves the shard (all-to-all) or gathers.
- reshape-like — ``view``, ``_unsafe_view``, ``reshape``, ``view_as``, ``flatten``, ``unflatten``: ``S(d) -> S(e)``
  where ``e`` is the output dim whose trailing elements equal input dim ``d``'s (``d`` leads a merged group or ``e``
  leads a split group), and only when **every rank's** block of ``d`` (nested over every mesh axis that shards
  ``d``) maps exactly onto its torch.chunk block of ``e``: ``[4, 2] S(0) -> [8]`` is kept on 2 ranks, ``[3, 2] S(0)
  -> [6]`` is not (local 4/2 elements vs chunks 3/3). Size arguments become the rank's local output shape.
- ``view_as`` / ``expand_as``: the ``other`` tensor only lends its shape and is accepted with any placement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, combinations, product
from typing import Any

import torch

from torch_dtorch.graph import OperatorCost, TensorMeta
from torch_dtorch.placement import Placement, Placements, Replicate, Shard, chunk_size_and_offset, is_partial
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.growth import bucket
from torch_dtorch.placement_rules.rule import Growth, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["VIEW_OPS", "distinct_partials", "norm_dim", "reshape_dim_pairs", "set_arg"]

aten = torch.ops.aten
_R = Replicate()
Pairs = Iterable[tuple[int, int]]


# --- shared helpers -----------------------------------------------------------------------------------------------


def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``[0, ndim)`` (a 0-d tensor accepts dims 0 and -1)."""
    return dim % ndim if ndim > 0 else 0


def distinct_partials(placements: Placements | None) -> list[Placement]:
    out: list[Placement] = []
    for p in placements or ():
        if is_partial(p) and p not in out:
            out.append(p)
    return out


def set_arg(call: OpCall, name: str, value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's args/kwargs with schema argument ``name`` set to ``value`` wherever the caller passed it."""
    args, kwargs = list(call.args), dict(call.kwargs)
    positional = [a.name for a in call.op._schema.arguments if not a.kwarg_only]
    i = positional.index(name) if name in positional else None
    if i is not None and i < len(args):
        args[i] = value
    else:
        kwargs[name] = value
    return tuple(args), kwargs


def _zero_cost(call: OpCall) -> OperatorCost:
    return OperatorCost()  # metadata only; a reshape that copies is counted by the copy it turns into


def _build(call: OpCall, pairs: Pairs) -> list[PlacementSignature]:
    """``S(d) -> S(e)`` per pair, ``P -> P`` for each Partial of input 0; ``*_as`` ops accept slot 1 as it is."""
    n_out = call.num_outputs
    if n_out == 0:
        return []
    heads: list[tuple[Placement, Placement]] = [(Shard(d), Shard(e)) for d, e in pairs]
    heads += [(p, p) for p in distinct_partials(call.placements[0])]
    if len(call.inputs) == 1:
        return [sig([i], [o] * n_out) for i, o in heads]
    others: list[Placement] = []
    for q in call.placements[1] or (_R,):
        if q not in others:
            others.append(q)
    return [sig([i, q], [o] * n_out) for i, o in [*heads, (_R, _R)] for q in others]


def _kernel_as(op: Any) -> Callable[[OpCall, LocalContext, tuple[Any, ...], dict[str, Any]], Any]:
    """A kernel that runs ``op`` on the localized arguments instead of the call's own overload (its ``local_op``:
    workers resolve such calls to ``op`` and replay them, ``OpRule.local_op``)."""

    def kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return op(*args, **kwargs)

    kernel.local_op = op  # type: ignore[attr-defined]
    return kernel


def _always(call: OpCall) -> bool:
    return True


def _view(*ops: Any, **kw: Any) -> Callable[[Any], Any]:
    return register_rule(*ops, family="view", intercept=True, view_of=0, cost=_zero_cost, **kw)


def _in_shape(call: OpCall) -> tuple[int, ...]:
    x = call.inputs[0]
    assert x is not None
    return tuple(x.shape)


# --- reshape-like views: layout check per rank --------------------------------------------------------------------


def _block(
    size: int, mesh_shape: Sequence[int], axes: Sequence[int], coord: Sequence[int]
) -> tuple[int, int]:
    """Start and length of one rank's block of a dim of ``size`` sharded over ``axes`` (nested, first axis first)."""
    start, length = 0, size
    for a, c in zip(axes, coord):
        length, off = chunk_size_and_offset(length, mesh_shape[a], c)
        start += off
    return start, length


def _maps_exactly(
    in_shape: Sequence[int],
    d: int,
    out_shape: Sequence[int],
    e: int,
    mesh_shape: Sequence[int],
    axes: Sequence[int],
) -> bool:
    """Whether sharding input dim ``d`` and output dim ``e`` over ``axes`` gives every rank the same elements.

    Both dims have the same trailing element count ``P`` (``prod(shape[d:])``), so a rank's elements are one
    interval of every period of ``P`` flat indices; the intervals must agree (empty blocks agree with each other).
    """
    rin, rout = math.prod(in_shape[d + 1 :]), math.prod(out_shape[e + 1 :])
    if in_shape[d] * rin != out_shape[e] * rout:
        return False
    if rin == rout or not axes:
        return True  # the same dim size: identical blocks
    for coord in product(*(range(mesh_shape[a]) for a in axes)):
        s_in, n_in = _block(in_shape[d], mesh_shape, axes, coord)
        s_out, n_out = _block(out_shape[e], mesh_shape, axes, coord)
        if n_in * rin != n_out * rout or (n_in and s_in * rin != s_out * rout):
            return False
    return True


def reshape_dim_pairs(
    in_shape: Sequence[int], out_shape: Sequence[int], mesh_shape: Sequence[int], current: Placements | None
) -> list[tuple[int, int]]:
    """``(d, e)``: input dim ``d`` may stay sharded as output dim ``e`` of a row-major reshape.

    Checked for the concrete mesh: the axes that shard ``d`` now, plus every subset of the axes whose current shard
    dim gets no signature (the matcher may move those onto ``d``). Dropping a dim adds movers, so this iterates to a
    fixed point.
    """
    if math.prod(in_shape) == 0:
        return []
    current = tuple(current or ())
    suffix_out = [math.prod(out_shape[e:]) for e in range(len(out_shape))]
    candidates = {
        d: [e for e in range(len(out_shape)) if suffix_out[e] == math.prod(in_shape[d:])]
        for d in range(len(in_shape))
    }
    listed = {d for d, es in candidates.items() if es}
    while True:
        movers = [a for a, p in enumerate(current) if isinstance(p, Shard) and p.dim not in listed]
        subsets = list(chain.from_iterable(combinations(movers, k) for k in range(len(movers) + 1)))
        pairs: list[tuple[int, int]] = []
        sharding = {
            d: [a for a, p in enumerate(current) if isinstance(p, Shard) and p.dim == d] for d in listed
        }
        # dims sharded now claim their output dim first
        for d in sorted(listed, key=lambda d: (not sharding[d], d)):
            here = sharding[d]
            for e in candidates[d]:
                if e in (f for _, f in pairs):
                    continue
                if all(
                    _maps_exactly(in_shape, d, out_shape, e, mesh_shape, sorted((*here, *t))) for t in subsets
                ):
                    pairs.append((d, e))
                    break
        if len(pairs) == len(listed):
            return sorted(pairs)
        listed = {d for d, _ in pairs}


def _reshape_signatures(call: OpCall) -> list[PlacementSignature]:
    mesh_shape = call.mesh.shape if call.mesh is not None else ()
    pairs = reshape_dim_pairs(_in_shape(call), call.out_meta[0].shape, mesh_shape, call.placements[0])
    return _build(call, pairs)


def _localize_size(name: str) -> Callable[[OpCall, LocalContext], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda call, ctx: set_arg(call, name, list(ctx.out_shapes[0]))


def _view_or_reshape(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """dtorch tensors report contiguous strides on the controller, while a rank's shard may be a strided view
    (after a transpose): the local ``view`` then falls back to ``reshape`` (a copy), as ``.contiguous().view``."""
    x, size = args[0], args[1]
    try:
        return x.view(size)
    except RuntimeError:
        return x.reshape(size)


# exactly ``reshape``: a view where the strides allow one (sharing the shard's storage), else a copy
_view_or_reshape.local_op = aten.reshape.default  # type: ignore[attr-defined]


@_view(
    aten.view.default,
    aten._unsafe_view.default,
    localize=_localize_size("size"),
    kernel=_view_or_reshape,
    as_is=_always,
)
def view(call: OpCall) -> list[PlacementSignature]:
    """Row-major reshape; a shard survives only where every rank's block maps onto its output chunk."""
    return _reshape_signatures(call)


@_view(aten.reshape.default, localize=_localize_size("shape"))
def reshape(call: OpCall) -> list[PlacementSignature]:
    """As ``view`` (a non-viewable input is copied, locally as globally)."""
    return _reshape_signatures(call)


@_view(aten.flatten.using_ints)
def flatten(call: OpCall) -> list[PlacementSignature]:
    """As ``view``; ``start_dim``/``end_dim`` need no localizing."""
    return _reshape_signatures(call)


def _localize_unflatten(call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
    dim = norm_dim(call.arg("dim"), len(_in_shape(call)))
    n = len(call.arg("sizes"))
    return set_arg(call, "sizes", list(ctx.out_shapes[0][dim : dim + n]))


@_view(aten.unflatten.int, localize=_localize_unflatten)
def unflatten(call: OpCall) -> list[PlacementSignature]:
    """As ``view``; ``sizes`` become the rank's local sizes."""
    return _reshape_signatures(call)


@_view(
    aten.view_as.default,
    localize=lambda call, ctx: ((call.arg("self"), list(ctx.out_shapes[0])), {}),
    kernel=_view_or_reshape,
)
def view_as(call: OpCall) -> list[PlacementSignature]:
    """As ``view`` to ``other``'s shape; runs locally as ``view(x, local shape)``."""
    return _reshape_signatures(call)


# --- dim-relabelling views ----------------------------------------------------------------------------------------


def _shifted(nd: int, removed: int) -> Pairs:
    """Every dim but ``removed``, later dims moving down by one."""
    return [(d, d if d < removed else d - 1) for d in range(nd) if d != removed]


def _all_but(nd: int, dim: int) -> Pairs:
    return [(d, d) for d in range(nd) if d != dim]


@_view(aten.alias.default, aten.detach.default)
def alias(call: OpCall) -> list[PlacementSignature]:
    """Identity: every placement passes through."""
    return _build(call, [(d, d) for d in range(len(_in_shape(call)))])


@_view(aten.permute.default)
def permute(call: OpCall) -> list[PlacementSignature]:
    """Output dim ``j`` is input dim ``dims[j]``."""
    nd = len(_in_shape(call))
    return _build(call, [(norm_dim(d, nd), j) for j, d in enumerate(call.arg("dims"))])


def _swap(nd: int, a: int, b: int) -> Pairs:
    a, b = norm_dim(a, nd), norm_dim(b, nd)
    return [(b if d == a else a if d == b else d, d) for d in range(nd)]


@_view(aten.transpose.int)
def transpose(call: OpCall) -> list[PlacementSignature]:
    """``dim0`` and ``dim1`` swap."""
    return _build(call, _swap(len(_in_shape(call)), call.arg("dim0"), call.arg("dim1")))


@_view(aten.t.default)
def t(call: OpCall) -> list[PlacementSignature]:
    """Dims 0 and 1 swap (identity below 2-d)."""
    nd = len(_in_shape(call))
    return _build(call, _swap(nd, 0, 1) if nd == 2 else [(d, d) for d in range(nd)])


@_view(aten.movedim.int, aten.movedim.intlist)
def movedim(call: OpCall) -> list[PlacementSignature]:
    """Dims ``source`` move to ``destination``; the rest keep their order."""
    nd = len(_in_shape(call))
    src, dst = call.arg("source"), call.arg("destination")
    src = [norm_dim(s, nd) for s in (src if isinstance(src, (list, tuple)) else [src])]
    dst = [norm_dim(s, nd) for s in (dst if isinstance(dst, (list, tuple)) else [dst])]
    origin: dict[int, int] = dict(zip(dst, src))
    rest_out = [e for e in range(nd) if e not in origin]
    origin.update(zip(rest_out, [d for d in range(nd) if d not in src]))
    return _build(call, [(d, e) for e, d in origin.items()])


@_view(aten.unsqueeze.default)
def unsqueeze(call: OpCall) -> list[PlacementSignature]:
    """Dims at or after ``dim`` move up by one."""
    nd = len(_in_shape(call))
    dim = norm_dim(call.arg("dim"), nd + 1)
    return _build(call, [(d, d if d < dim else d + 1) for d in range(nd)])


def _squeezed(call: OpCall) -> list[int]:
    """The dims ``squeeze`` removes: requested dims of global size 1 (all size-1 dims for ``squeeze.default``)."""
    shape = _in_shape(call)
    nd = len(shape)
    if call.op is aten.squeeze.default:
        dims: Iterable[int] = range(nd)
    elif call.op is aten.squeeze.dim:
        dims = [call.arg("dim")]
    else:
        dims = call.arg("dim")
    return sorted({norm_dim(d, nd) for d in dims if nd and shape[norm_dim(d, nd)] == 1})


@_view(
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    localize=lambda call, ctx: ((call.arg("self"), _squeezed(call)), {}),
    kernel=_kernel_as(aten.squeeze.dims),
    as_is=_always,
)
def squeeze(call: OpCall) -> list[PlacementSignature]:
    """Removes global size-1 dims (never sharded); runs locally as ``squeeze.dims`` on exactly those dims."""
    removed = _squeezed(call)
    nd = len(_in_shape(call))
    kept = [d for d in range(nd) if d not in removed]
    return _build(call, [(d, e) for e, d in enumerate(kept)])


# --- broadcasting and slicing views -------------------------------------------------------------------------------


def _expand_pairs(in_shape: Sequence[int], out_shape: Sequence[int]) -> Pairs:
    lead = len(out_shape) - len(in_shape)
    return [(d, d + lead) for d in range(len(in_shape)) if in_shape[d] == out_shape[d + lead]]


@_view(aten.expand.default, localize=_localize_size("size"))
def expand(call: OpCall) -> list[PlacementSignature]:
    """Non-broadcast dims stay sharded (shifted by the new leading dims); sizes become local."""
    return _build(call, _expand_pairs(_in_shape(call), call.out_meta[0].shape))


@_view(
    aten.expand_as.default,
    localize=lambda call, ctx: ((call.arg("self"), list(ctx.out_shapes[0])), {}),
    kernel=_kernel_as(aten.expand.default),
)
def expand_as(call: OpCall) -> list[PlacementSignature]:
    """As ``expand`` to ``other``'s shape; runs locally as ``expand(x, local shape)``."""
    return _build(call, _expand_pairs(_in_shape(call), call.out_meta[0].shape))


def _slice_full(call: OpCall, shape: Sequence[int], dim: int) -> bool:
    start, end, step = call.arg("start"), call.arg("end"), call.arg("step")
    return start in (None, 0) and (end is None or end >= shape[dim]) and step == 1


def _slice_growth_key(call: OpCall) -> Any:
    """The signatures see the rank, the sliced dim, whether the slice is full and (through the matcher's
    empty-shard test) the bucketed lengths: a growing ``ids[:, -1:]`` reuses its decision (``growth.py``)."""
    x = call.inputs[0]
    step = call.arg("step")
    if x is None or call.mesh is None or x.ndim == 0 or type(step) is not int or step < 1:
        return None
    shape = x.shape
    dim = norm_dim(call.arg("dim"), len(shape))
    return (dim, _slice_full(call, shape, dim), tuple(bucket(n, call.mesh) for n in shape))


def _slice_grown_meta(call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
    """torch's ``slice``: the dim's length from the clamped range, its stride times ``step``."""
    x = call.inputs[0]
    assert x is not None
    start, end, step = call.arg("start"), call.arg("end"), call.arg("step")
    if x.stride is None or not all(v is None or type(v) is int for v in (start, end)):
        return None
    shape, stride = list(x.shape), list(x.stride)
    dim = norm_dim(call.arg("dim"), len(shape))
    shape[dim] = len(range(*slice(start, end, step).indices(shape[dim])))
    stride[dim] *= step
    return [TensorMeta(tuple(shape), kept[0].dtype, tuple(stride))]


@_view(aten.slice.Tensor, growth=Growth(_slice_growth_key, _slice_grown_meta))
def slice_(call: OpCall) -> list[PlacementSignature]:
    """Every dim but the sliced one; a full slice (``x[:, :]``) keeps that one too."""
    shape = _in_shape(call)
    dim = norm_dim(call.arg("dim"), len(shape))
    full = _slice_full(call, shape, dim)
    return _build(call, [(d, d) for d in range(len(shape))] if full else _all_but(len(shape), dim))


@_view(aten.narrow.default)
def narrow(call: OpCall) -> list[PlacementSignature]:
    """Every dim but the narrowed one."""
    nd = len(_in_shape(call))
    return _build(call, _all_but(nd, norm_dim(call.arg("dim"), nd)))


@_view(aten.select.int)
def select(call: OpCall) -> list[PlacementSignature]:
    """Every dim but the selected one, later dims moving down."""
    nd = len(_in_shape(call))
    return _build(call, _shifted(nd, norm_dim(call.arg("dim"), nd)))


@_view(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default)
def split(call: OpCall) -> list[PlacementSignature]:
    """Every dim but the split one; every piece gets the same placement."""
    nd = len(_in_shape(call))
    return _build(call, _all_but(nd, norm_dim(call.arg("dim"), nd)))


@_view(aten.unbind.int)
def unbind(call: OpCall) -> list[PlacementSignature]:
    """Every dim but the unbound one, later dims moving down; every slice gets the same placement."""
    nd = len(_in_shape(call))
    return _build(call, _shifted(nd, norm_dim(call.arg("dim"), nd)))


VIEW_OPS = [
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_as.default,
    aten.flatten.using_ints, aten.unflatten.int, aten.alias.default, aten.detach.default, aten.permute.default,
    aten.transpose.int, aten.t.default, aten.movedim.int, aten.movedim.intlist, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default, aten.expand_as.default,
    aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.unbind.int, aten.as_strided.default,
]  # fmt: skip


@_view(aten.as_strided.default)
def as_strided(call: OpCall) -> list[PlacementSignature]:
    """Addresses global memory: Replicate only (the device refuses sharded inputs with a typed error)."""
    return []
