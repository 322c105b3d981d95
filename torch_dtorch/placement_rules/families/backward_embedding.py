"""The weight gradient of a vocab-parallel embedding, computed on the rows each rank holds.

``aten.embedding_dense_backward`` does not see the weight, so its rule cannot know that the weight is ``S(0)``
(vocab parallel): it produces the whole ``[V, D]`` gradient on every rank. ``dtorch_train::embedding_rows_backward
(grad, indices, weight, padding_idx, scale_grad_by_freq)`` takes the weight as an input (for its placement only:
an exact match, never moved), so the gradient is born in the weight's placements. The parallel styles' row-parallel
``nn.Embedding`` and ``dt.nn.Embedding(tp_shard_type="row")`` use it through :func:`vocab_parallel_embedding`.

Signatures (one mesh axis): weight ``S(0)`` with ``grad``/``indices`` ``R`` -> ``S(0)`` (each rank scatters the
rows of its vocab range: indices outside it go to a scratch row that is dropped, so ``scale_grad_by_freq`` counts
stay exact); ``grad``/``indices`` ``S(d)`` on a batch dim with the weight ``R`` -> ``P(sum)`` (not with
``scale_grad_by_freq``); ``grad`` ``S(-1)``, ``indices`` ``R``, weight ``S(1)`` -> ``S(1)``. The weight is pinned:
``grad`` and ``indices`` move to the weight's signature, never the other way round.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_dtorch.placement import Partial, Replicate, Shard, is_shard, local_shape_and_offset
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import get_rule, register_rule, request_device_kernels
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["vocab_parallel_embedding"]

_R = Replicate()


@torch.library.custom_op("dtorch_train::embedding_rows_backward", mutates_args=())
def embedding_rows_backward(
    grad: torch.Tensor,
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    """On plain tensors: ``embedding_dense_backward`` (the weight gives the row count)."""
    return torch.ops.aten.embedding_dense_backward(
        grad, indices, weight.shape[0], padding_idx, scale_grad_by_freq
    )


@embedding_rows_backward.register_fake
def _(
    grad: torch.Tensor,
    indices: torch.Tensor,
    weight: torch.Tensor,
    padding_idx: int,
    scale_grad_by_freq: bool,
) -> torch.Tensor:
    return grad.new_empty((weight.shape[0], grad.shape[-1]))


def _kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    grad, indices, weight, padding_idx, scale = args[:5]
    w = call.inputs[2]
    pw = call.placements[2]
    assert w is not None and pw is not None and call.mesh is not None
    rows = weight.shape[0]
    if rows == w.shape[0]:
        return torch.ops.aten.embedding_dense_backward(grad, indices, rows, padding_idx, scale)
    vocab = [Shard(0) if is_shard(p, 0) else _R for p in pw]
    (_,), (offset,) = local_shape_and_offset((w.shape[0],), call.mesh.shape, vocab, ctx.coordinate)
    local = indices - offset
    valid = (local >= 0) & (local < rows)
    pad = padding_idx - offset if 0 <= padding_idx - offset < rows else -1
    # out-of-range indices scatter into a scratch row ``rows`` (dropped), so counts and masks stay exact
    out = torch.ops.aten.embedding_dense_backward(grad, local.masked_fill(~valid, rows), rows + 1, pad, scale)
    return out[:rows].contiguous()


@register_rule(torch.ops.dtorch_train.embedding_rows_backward.default, family="backward", kernel=_kernel)
def embedding_rows_backward_rule(call: OpCall) -> list[PlacementSignature]:
    grad, idx, _ = call.inputs
    assert grad is not None and idx is not None
    sigs = [sig([_R, _R, Shard(0)], Shard(0)), sig([Shard(grad.ndim - 1), _R, Shard(1)], Shard(1))]
    if not call.arg("scale_grad_by_freq"):
        sigs += [sig([Shard(d), Shard(d), _R], Partial("sum")) for d in range(idx.ndim)]
    return sigs


# the weight is only read for its placement: never moved (a signature that needs it elsewhere does not apply)
get_rule(torch.ops.dtorch_train.embedding_rows_backward.default).pinned_inputs = (2,)


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, weight: torch.Tensor, indices: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(weight, indices)
        ctx.padding_idx, ctx.scale = padding_idx, scale_grad_by_freq
        return torch.nn.functional.embedding(indices, weight, padding_idx, None, 2.0, scale_grad_by_freq)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        weight, indices = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        gw = torch.ops.dtorch_train.embedding_rows_backward(
            grad, indices, weight.detach(), -1 if ctx.padding_idx is None else ctx.padding_idx, ctx.scale
        )
        return gw, None, None, None


request_device_kernels([torch.ops.dtorch_train.embedding_rows_backward.default])


def vocab_parallel_embedding(
    indices: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, scale_grad_by_freq: bool
) -> torch.Tensor:
    """``F.embedding(indices, weight, padding_idx, scale_grad_by_freq=...)`` whose weight gradient is computed on
    each rank's rows (see the module doc); plain ``F.embedding`` when no gradient is needed or while compiling."""
    if not (torch.is_grad_enabled() and weight.requires_grad) or torch.compiler.is_compiling():
        return torch.nn.functional.embedding(indices, weight, padding_idx, None, 2.0, scale_grad_by_freq)
    return _VocabParallelEmbedding.apply(weight, indices, padding_idx, scale_grad_by_freq)
