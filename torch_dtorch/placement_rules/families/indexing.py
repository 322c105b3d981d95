"""Indexing family: gather/scatter, index_select/index_add/index_copy/index_fill/index_reduce, advanced indexing.

Signatures (one mesh axis), ``dim`` being the indexed dim:

- ``index_select(self, dim, index)``: ``self S(d)``, ``index R`` -> ``S(d)`` for ``d != dim``.
- ``gather(self, dim, index)``: ``self S(d)``, ``index S(d)`` -> ``S(d)`` for ``d != dim`` where ``index`` has
  ``self``'s size on ``d`` (then both chunk alike).
- ``scatter*(self, dim, index, src)``, ``scatter_add``, ``scatter_reduce``: ``self``, ``index`` (and ``src``) ``S(d)``
  -> ``S(d)`` for ``d != dim`` where all of them have ``self``'s size on ``d``.
- ``index_add/index_copy/index_reduce(self, dim, index, source)``, ``index_fill``: ``self S(d)`` (``source S(d)``),
  ``index R`` -> ``S(d)`` for ``d != dim``.
- ``index.Tensor(self, indices)``: ``self S(d)``, every index ``R`` -> ``S(d)`` for the dims before the first indexed
  dim (they keep their position in the output).
- ``index_put``, ``take``, ``put``, ``masked_scatter``: Replicate only (the write or read pattern crosses shards).

Data-dependent output shapes (``masked_select``, ``nonzero``, ``unique*``, ``equal``'s Python bool) cannot be
inferred from metadata: they are **sync points** listed in :data:`SYNC_OPS`. The device gathers the inputs, runs
the op on the controller and returns a Replicate result on the inputs' mesh (logged at DEBUG).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torch_dtorch.placement import Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.families.view import norm_dim
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["SYNC_OPS", "keep_dim_signatures"]

aten = torch.ops.aten
_R = Replicate()


def keep_dim_signatures(
    call: OpCall, dims: Sequence[int], sharded: Sequence[int], *, out_dims: Sequence[int] | None = None
) -> list[PlacementSignature]:
    """For each ``d`` in ``dims``: input slots in ``sharded`` ``S(d)``, the others ``R`` -> every output
    ``S(out_dims[i])`` (default ``S(d)``)."""
    n = len(call.inputs)
    sigs = []
    for i, d in enumerate(dims):
        ins: list[Placement] = [Shard(d) if k in sharded else _R for k in range(n)]
        o = Shard(out_dims[i] if out_dims is not None else d)
        sigs.append(sig(ins, [o] * call.num_outputs))
    return sigs


def _dim(call: OpCall, nd: int) -> int:
    return norm_dim(int(call.arg("dim")), nd)


def _same_size_dims(call: OpCall, slots: Sequence[int], skip: int) -> list[int]:
    x = call.inputs[0]
    assert x is not None
    out = []
    for d in range(x.ndim):
        if d == skip:
            continue
        ok = all(
            (y := call.inputs[k]) is not None and y.ndim == x.ndim and y.shape[d] == x.shape[d] for k in slots
        )
        if ok:
            out.append(d)
    return out


@register_rule(aten.index_select.default, family="indexing")
def index_select(call: OpCall) -> list[PlacementSignature]:
    """Dims other than ``dim`` stay sharded; the index is Replicate."""
    x = call.inputs[0]
    assert x is not None
    dim = _dim(call, x.ndim)
    return keep_dim_signatures(call, [d for d in range(x.ndim) if d != dim], [0])


@register_rule(aten.gather.default, family="indexing")
def gather(call: OpCall) -> list[PlacementSignature]:
    """``self`` and ``index`` sharded alike on a dim other than ``dim`` where their sizes agree."""
    x = call.inputs[0]
    assert x is not None
    dim = _dim(call, x.ndim)
    return keep_dim_signatures(call, _same_size_dims(call, [1], dim), [0, 1])


@register_rule(
    aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce, aten.scatter_add.default,
    aten.scatter_reduce.two, family="indexing",
)  # fmt: skip
def scatter(call: OpCall) -> list[PlacementSignature]:
    """``self``, ``index`` (and ``src``) sharded alike on a dim other than ``dim`` where all sizes agree."""
    x = call.inputs[0]
    assert x is not None
    dim = _dim(call, x.ndim)
    slots = list(range(1, len(call.inputs)))
    return keep_dim_signatures(call, _same_size_dims(call, slots, dim), [0, *slots])


@register_rule(
    aten.index_add.default, aten.index_copy.default, aten.index_reduce.default, aten.index_fill.int_Scalar,
    aten.index_fill.int_Tensor, family="indexing",
)  # fmt: skip
def index_update(call: OpCall) -> list[PlacementSignature]:
    """``self`` (and ``source``) sharded on a dim other than ``dim``; ``index`` (and a 0-d fill value) Replicate."""
    x = call.inputs[0]
    assert x is not None
    dim = _dim(call, x.ndim)
    sharded = [0]
    src = call.inputs[2] if len(call.inputs) > 2 else None
    if src is not None and src.ndim == x.ndim:
        sharded.append(2)
        dims = [d for d in _same_size_dims(call, [2], dim)]
    elif src is not None and src.ndim != 0:
        dims = []
    else:
        dims = [d for d in range(x.ndim) if d != dim]
    return keep_dim_signatures(call, dims, sharded)


@register_rule(aten.index.Tensor, family="indexing")
def index(call: OpCall) -> list[PlacementSignature]:
    """Dims before the first indexed dim stay sharded (they keep their place in the output)."""
    x = call.inputs[0]
    assert x is not None
    indices = list(call.arg("indices"))
    first = next((i for i, t in enumerate(indices) if t is not None), len(indices))
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return []  # a boolean mask: data-dependent output size (the op itself is a sync on a mask)
    return keep_dim_signatures(call, list(range(min(first, x.ndim))), [0])


@register_rule(
    aten.index_put.default,
    aten.take.default,
    aten.put.default,
    aten.masked_scatter.default,
    family="indexing",
)
def replicate_only_indexing(call: OpCall) -> list[PlacementSignature]:
    """Reads or writes at data-dependent positions across the whole tensor: Replicate only."""
    return []


#: ops whose output shape (or Python result) depends on the data: run on the controller, a sync point
SYNC_OPS = (
    aten.masked_select.default,
    aten.nonzero.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.equal.default,
    aten.bincount.default,
)


def is_sync_call(op: object, args: Sequence[object], kwargs: dict[str, object]) -> bool:
    """Whether this call's output shape depends on the data (see :data:`SYNC_OPS`; ``x[mask]`` too)."""
    if op in SYNC_OPS:
        return True
    if op is aten.index.Tensor or op is aten.index_put.default:
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        return any(
            isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)
            for t in (indices or ())  # type: ignore[attr-defined]
        )
    return False
