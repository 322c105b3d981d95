"""Embedding family: ``embedding(weight [V, D], indices [*]) -> [*, D]``.

Signatures (one mesh axis):
- indices ``S(d)``, weight ``R`` -> ``S(d)`` for every indices dim.
- weight ``S(1)`` (embedding dim), indices ``R`` -> ``S(-1)``.
- linearity in the weight: weight ``P(sum|avg)``, indices ``R`` -> same ``P``.
- **vocab parallel**: weight ``S(0)``, indices ``R`` -> ``P(sum)``. Each rank looks up the indices that fall in
  its vocab rows ``[offset, offset + V_local)`` (shifted by ``offset``) and zeroes the other rows, so the sum over
  the axis is the full lookup. The kernel learns which axes shard the vocab from the weight's placements at the
  call, so this signature is offered only when every mesh axis (of size > 1) has an *exact* match — then the
  matcher takes the exact one and never moves the weight onto ``S(0)`` by cost (where the vocab axis could not be
  known). Indices outside ``[0, V)`` raise, as in torch (a device-side assert, no host sync).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_dtorch.errors import DTorchError
from torch_dtorch.graph import Operand
from torch_dtorch.placement import (
    LINEAR_REDUCE_OPS,
    Partial,
    Placement,
    Replicate,
    Shard,
    is_shard,
    local_shape_and_offset,
)
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["embedding_signatures"]

aten = torch.ops.aten
_R = Replicate()


def _weight_indices(call: OpCall) -> tuple[Operand, Operand]:
    w, idx = call.inputs
    assert w is not None and idx is not None
    return w, idx


def _exact(w: Placement, i: Placement) -> bool:
    """Whether the pair (weight, indices) on one axis equals one of the signatures."""
    if type(i) is Replicate:
        return type(w) in (Replicate, Shard) or (isinstance(w, Partial) and w.reduce_op in LINEAR_REDUCE_OPS)
    return type(i) is Shard and type(w) is Replicate


def _vocab_parallel_ok(call: OpCall) -> bool:
    if call.mesh is None:
        return False
    pw, pi = call.placements
    assert pw is not None and pi is not None
    return all(n == 1 or _exact(w, i) for n, w, i in zip(call.mesh.shape, pw, pi))


def embedding_signatures(call: OpCall) -> list[PlacementSignature]:
    _, idx = _weight_indices(call)
    sigs = [sig([_R, Shard(d)], Shard(d)) for d in range(idx.ndim)]
    sigs.append(sig([Shard(1), _R], Shard(idx.ndim)))
    sigs.append(sig([_R, _R], _R))  # before the Partial ones: a Replicate output wins cost ties
    sigs += [sig([Partial(op), _R], Partial(op)) for op in LINEAR_REDUCE_OPS]
    if _vocab_parallel_ok(call):
        sigs.append(sig([Shard(0), _R], Partial("sum")))
    return sigs


def _vocab_offset(call: OpCall, ctx: LocalContext, local_rows: int) -> int:
    """First vocab row of this rank's weight shard (the axes where the weight is ``S(0)`` at the call)."""
    w, _ = _weight_indices(call)
    pw = call.placements[0]
    assert pw is not None and call.mesh is not None
    vocab = [Shard(0) if is_shard(p, 0) else _R for p in pw]
    (rows,), (offset,) = local_shape_and_offset((w.shape[0],), call.mesh.shape, vocab, ctx.coordinate)
    if rows != local_rows:
        raise DTorchError(
            f"{call.op}: internal error: vocab-parallel weight shard has {local_rows} rows on rank {ctx.coordinate}, "
            f"its placements {pw} imply {rows}"
        )
    return offset


def _kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Plain lookup, or the masked vocab-parallel lookup when the weight holds only some rows."""
    weight, indices = args[0], args[1]
    w, _ = _weight_indices(call)
    vocab = w.shape[0]
    rows = weight.shape[0]
    if rows == vocab:
        return call.op(*args, **kwargs)
    torch._assert_async(
        ((indices >= 0) & (indices < vocab)).all(),
        f"{call.op}: index out of range in self (num_embeddings={vocab})",
    )
    local = indices - _vocab_offset(call, ctx, rows)
    valid = (local >= 0) & (local < rows)
    if rows == 0:
        return weight.new_zeros((*indices.shape, weight.shape[1]))
    out = call.op(weight, local.masked_fill(~valid, 0))
    return out.masked_fill(~valid.unsqueeze(-1), 0)


def _whole_vocab(call: OpCall) -> bool:
    """Every rank holds every row of the weight: :func:`_kernel` is the plain lookup (workers replay it)."""
    mesh, pw = call.mesh, call.placements[0]
    if mesh is None or pw is None:
        return False
    return not any(mesh.shape[a] > 1 and isinstance(p, Shard) and p.dim % 2 == 0 for a, p in enumerate(pw))


@register_rule(aten.embedding.default, family="embedding", kernel=_kernel, as_is=_whole_vocab)
def embedding(call: OpCall) -> list[PlacementSignature]:
    """Indices sharded, embedding dim sharded, linear in the weight, vocab parallel (masked local lookup)."""
    return embedding_signatures(call)
