"""View family, continued: the views torch builds with ``as_strided`` (``diagonal``, ``unfold``,
``view_as_complex``; family ``view``), their functional inverses (``slice_scatter``, ``select_scatter``,
``diagonal_scatter``) and ``rot90`` (copies: family ``shape``). Each is intercepted so that it reaches the ``dtorch`` key whole: a sharded operand has no global storage
for an ``as_strided`` to address, while every rank can run the op itself on its shard.

Signatures (one mesh axis):
- ``diagonal(x, offset, dim1, dim2)`` (a view): ``S(d) -> S(d')`` for ``d`` not in ``{dim1, dim2}``, ``d'`` its
  position among the kept dims (the diagonal becomes the last dim); ``P -> P``.
- ``unfold(x, dimension, size, step)`` (a view): ``S(d) -> S(d)`` for ``d != dimension`` (the window dim is
  appended last); ``P -> P``.
- ``view_as_complex(x)`` (a view): ``S(d) -> S(d)`` for every dim but the last (the real/imag pair); ``P -> P``.
- ``slice_scatter`` / ``select_scatter`` / ``diagonal_scatter(self, src, ...)``: ``self S(d), src S(d') -> S(d)``
  for every dim ``d`` of ``self`` the op does not address, ``d'`` where it lives in ``src`` (the slice, select or
  diagonal of ``self``); ``P, P -> P`` (the result is linear in ``self`` and ``src`` together).
- ``rot90(x, k, dims)``: ``S(d) -> S(d)`` for ``d`` not in ``dims`` (the rotated plane stays whole); ``P -> P``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch.placement import Placement, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.families.view import _zero_cost, distinct_partials, norm_dim
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["STRIDED_VIEW_OPS"]

aten = torch.ops.aten

#: the views of this module (family ``view``, like ``view.VIEW_OPS``); the rest are copies (family ``shape``)
STRIDED_VIEW_OPS = [aten.diagonal.default, aten.unfold.default, aten.view_as_complex.default]


def _ndim(call: OpCall, slot: int = 0) -> int:
    x = call.inputs[slot]
    assert x is not None
    return len(x.shape)


def _unary(call: OpCall, pairs: Sequence[tuple[int, int]]) -> list[PlacementSignature]:
    heads: list[tuple[Placement, Placement]] = [(Shard(d), Shard(e)) for d, e in pairs]
    heads += [(p, p) for p in distinct_partials(call.placements[0])]
    return [sig([i], o) for i, o in heads]


def _binary(call: OpCall, pairs: Sequence[tuple[int, int]]) -> list[PlacementSignature]:
    """``self S(d), src S(e) -> S(d)`` per pair ``(d, e)``; ``P, P -> P`` for each Partial of ``self``."""
    out = [sig([Shard(d), Shard(e)], Shard(d)) for d, e in pairs]
    out += [sig([p, p], p) for p in distinct_partials(call.placements[0])]
    return out


def _kept(nd: int, removed: Sequence[int]) -> list[tuple[int, int]]:
    """``(d, position of d among the dims not removed)``."""
    kept = [d for d in range(nd) if d not in removed]
    return [(d, i) for i, d in enumerate(kept)]


def _view(*ops: Any) -> Callable[[Any], Any]:
    return register_rule(*ops, family="view", intercept=True, view_of=0, cost=_zero_cost)


def _diag_dims(call: OpCall) -> tuple[int, int]:
    nd = _ndim(call)
    return norm_dim(call.arg("dim1"), nd), norm_dim(call.arg("dim2"), nd)


@_view(aten.diagonal.default)
def diagonal(call: OpCall) -> list[PlacementSignature]:
    """Every dim but ``dim1``/``dim2``, renumbered among the kept dims."""
    return _unary(call, _kept(_ndim(call), _diag_dims(call)))


@_view(aten.unfold.default)
def unfold(call: OpCall) -> list[PlacementSignature]:
    """Every dim but ``dimension`` keeps its place."""
    nd = _ndim(call)
    dim = norm_dim(call.arg("dimension"), nd)
    return _unary(call, [(d, d) for d in range(nd) if d != dim])


@_view(aten.view_as_complex.default)
def view_as_complex(call: OpCall) -> list[PlacementSignature]:
    """Every dim but the last (the real/imaginary pair)."""
    return _unary(call, [(d, d) for d in range(_ndim(call) - 1)])


@register_rule(aten.rot90.default, family="shape", intercept=True)
def rot90(call: OpCall) -> list[PlacementSignature]:
    """Every dim outside the rotated plane."""
    nd = _ndim(call)
    plane = [norm_dim(d, nd) for d in call.arg("dims")]
    return _unary(call, [(d, d) for d in range(nd) if d not in plane])


@register_rule(aten.slice_scatter.default, family="shape", intercept=True)
def slice_scatter(call: OpCall) -> list[PlacementSignature]:
    """``src`` is the slice: same rank, every dim but ``dim`` aligned with ``self``."""
    nd = _ndim(call)
    dim = norm_dim(call.arg("dim"), nd)
    return _binary(call, [(d, d) for d in range(nd) if d != dim])


@register_rule(aten.select_scatter.default, family="shape", intercept=True)
def select_scatter(call: OpCall) -> list[PlacementSignature]:
    """``src`` is the selected slice: ``self``'s dims without ``dim``."""
    nd = _ndim(call)
    return _binary(call, _kept(nd, [norm_dim(call.arg("dim"), nd)]))


@register_rule(aten.diagonal_scatter.default, family="shape", intercept=True)
def diagonal_scatter(call: OpCall) -> list[PlacementSignature]:
    """``src`` is the diagonal: ``self``'s dims without ``dim1``/``dim2``, then the diagonal."""
    return _binary(call, _kept(_ndim(call), _diag_dims(call)))
