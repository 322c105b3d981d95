"""Backward family: the aten overloads autograd produces for the forwards of an MLP / transformer block that have no
forward twin among the other families (``threshold_backward``, ``gelu_backward``, ``silu_backward`` are pointwise,
``_softmax_backward_data`` / ``_log_softmax_backward_data`` live with the along-dim ops, ``mm``/``bmm`` of transposed
operands and the expands of reductions are ordinary matmul/view calls).

Signatures (one mesh axis):

- ``native_layer_norm_backward(grad_out, input, mean, rstd, weight?, bias?, output_mask)``: every tensor but
  ``weight``/``bias`` ``S(d)`` on a leading (not normalized) dim ``d``, ``weight``/``bias`` ``R`` -> ``grad_input``
  ``S(d)``, ``grad_weight``/``grad_bias`` ``P(sum)`` (each rank sums its rows). All three outputs are linear in
  ``grad_out``: ``grad_out`` ``P`` with the rest ``R`` -> every output ``P``. Outputs masked off by
  ``output_mask`` (or for an absent weight/bias) are ``None``, as in torch.
- ``embedding_dense_backward(grad_output [*, D], indices [*], num_weights, ...)``: ``grad_output`` and ``indices``
  ``S(d)`` on a batch dim -> ``P(sum)`` (not with ``scale_grad_by_freq``, whose counts need every index);
  ``grad_output`` ``S(-1)``, ``indices`` ``R`` -> ``S(1)``; ``grad_output`` ``P``, ``indices`` ``R`` -> ``P``.
  A vocab-parallel weight gets the ``R`` gradient, which its ``S(0)`` placement slices for free.
- ``nll_loss_backward`` / ``nll_loss2d_backward``: ``self`` sharded on any dim but the class dim (1, or 0 for an
  unbatched ``[C]`` input) with ``target`` (and ``grad_output`` for ``reduction='none'``) on the aligned dim,
  ``weight``/``total_weight`` ``R`` -> ``S(d)``; ``total_weight`` is the global one, so ``'mean'`` is exact.
  ``grad_output`` ``P`` with the rest ``R`` -> ``P``.
- ``mse_loss`` (forward, an elementwise loss: see ``loss.py``) and ``mse_loss_backward``: ``self``/``target``
  sharded alike (broadcast dims ``R``), a reduced loss's 0-d ``grad_output`` ``R`` -> ``S(d)``; the local kernel
  divides by the GLOBAL element count for ``'mean'``. ``grad_output`` ``P`` with the rest ``R`` -> ``P``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.placement import Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.loss import REDUCTION_MEAN, REDUCTION_NONE, ElementwiseLossRule
from torch_dtorch.placement_rules.families.pointwise import broadcast_shard_signatures
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["MASKED_OUTPUT_OPS", "present_outputs"]

aten = torch.ops.aten
_R = Replicate()
_P = Partial("sum")


def _present(inputs: Sequence[Any], n: int) -> list[Placement | None]:
    return [None if x is None else _R for x in inputs[:n]]


def _partial_grad_signature(call: OpCall) -> PlacementSignature:
    """``grad_output`` (slot 0) ``P(sum)``, every other present input ``R`` -> every output ``P(sum)``: the op is
    linear in ``grad_output``."""
    ins: list[Placement] = [_P] + [_R] * (len(call.inputs) - 1)
    return sig(ins, [_P] * max(len(call.out_meta), 1))


# --- layer norm -----------------------------------------------------------------------------------------------------


def _layer_norm_present(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[bool, bool, bool]:
    """Which of ``(grad_input, grad_weight, grad_bias)`` torch returns (not ``None``) for this call."""
    names = [a.name for a in aten.native_layer_norm_backward.default._schema.arguments]
    bound = dict(zip(names, args, strict=False)) | kwargs
    mask = list(bound["output_mask"])
    return (
        bool(mask[0]),
        bool(mask[1]) and bound.get("weight") is not None,
        bool(mask[2]) and (bound.get("bias") is not None),
    )


def _layer_norm_backward_kernel(
    call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The op on the rank's rows; ``None`` outputs dropped (the operator has only the present ones)."""
    return [t for t in call.op(*args, **kwargs) if t is not None]


def _all_present(call: OpCall) -> bool:
    """Every output is present: :func:`_layer_norm_backward_kernel` is the op itself (workers replay it)."""
    return all(_layer_norm_present(call.args, call.kwargs))


@register_rule(
    aten.native_layer_norm_backward.default,
    family="backward",
    kernel=_layer_norm_backward_kernel,
    as_is=_all_present,
)
def native_layer_norm_backward(call: OpCall) -> list[PlacementSignature]:
    """Leading dims sharded -> ``grad_input`` ``S(d)``, ``grad_weight``/``grad_bias`` ``P(sum)``; linear in
    ``grad_out``."""
    x = call.inputs[1]
    assert x is not None
    leading = x.ndim - len(call.arg("normalized_shape"))
    gi, _, _ = _layer_norm_present(call.args, call.kwargs)
    n_out = len(call.out_meta)
    sigs = []
    for d in range(max(leading, 0)):
        ins: list[Placement | None] = [Shard(d)] * 4 + _present(call.inputs[4:], 2)
        outs: list[Placement] = ([Shard(d)] if gi else []) + [_P] * (n_out - (1 if gi else 0))
        sigs.append(sig([p if p is not None else _R for p in ins], outs))
    if n_out:
        sigs.append(_partial_grad_signature(call))
    return sigs


#: ops whose outputs torch may return as ``None``: the operator holds only the present ones, and the device
#: kernel (``device/registration.py``) puts the ``None`` back where ``present_outputs`` says
MASKED_OUTPUT_OPS = {aten.native_layer_norm_backward.default: _layer_norm_present}


def present_outputs(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[bool, ...]:
    return MASKED_OUTPUT_OPS[op](args, kwargs)


# --- embedding ------------------------------------------------------------------------------------------------------


@register_rule(aten.embedding_dense_backward.default, family="backward")
def embedding_dense_backward(call: OpCall) -> list[PlacementSignature]:
    """Batch dims sharded -> ``P(sum)`` (without ``scale_grad_by_freq``); embedding dim sharded -> ``S(1)``;
    linear in ``grad_output``."""
    grad, idx = call.inputs
    assert grad is not None and idx is not None
    sigs = []
    if not call.arg("scale_grad_by_freq"):
        sigs += [sig([Shard(d), Shard(d)], _P) for d in range(idx.ndim)]
    sigs.append(sig([Shard(grad.ndim - 1), _R], Shard(1)))
    sigs.append(sig([_P, _R], _P))
    return sigs


# --- nll loss -------------------------------------------------------------------------------------------------------


@register_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default, family="backward")
def nll_loss_backward(call: OpCall) -> list[PlacementSignature]:
    """Every dim of ``self`` but the class dim sharded with ``target`` (and an unreduced ``grad_output``) on the
    aligned dim; ``weight``/``total_weight`` ``R``; linear in ``grad_output``."""
    grad, x, target, weight, total = call.inputs
    assert grad is not None and x is not None and target is not None
    class_dim = 0 if x.ndim == 1 else 1
    sigs = []
    for d in range(x.ndim):
        if d == class_dim:
            continue
        td = d if d < class_dim else d - 1  # target has no class dim
        g = Shard(td) if grad.ndim == target.ndim and grad.ndim > 0 else _R
        ins: list[Placement] = [g, Shard(d), Shard(td), _R, _R]
        if weight is None:
            ins[3] = _R  # an absent optional slot matches anything
        sigs.append(sig(ins, Shard(d)))
    sigs.append(_partial_grad_signature(call))
    return sigs


# --- mse loss -------------------------------------------------------------------------------------------------------

register_rule(aten.mse_loss.default, family="loss")(ElementwiseLossRule)


def _mse_backward_kernel(
    call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """torch's formula ``(self - target) * norm * grad_output`` with ``norm = 2 / numel`` of the GLOBAL broadcast
    shape for ``'mean'`` (a shard's own count would be wrong)."""
    grad, x, target = args[0], args[1], args[2]
    reduction = int(call.arg("reduction", REDUCTION_MEAN))
    if reduction != REDUCTION_MEAN:
        return call.op(*args, **kwargs)
    gx, gt = call.inputs[1], call.inputs[2]
    assert gx is not None and gt is not None
    full = torch.broadcast_shapes(torch.Size(gx.shape), torch.Size(gt.shape))
    if tuple(torch.broadcast_shapes(x.shape, target.shape)) == tuple(full):
        return call.op(*args, **kwargs)
    norm = 2.0 / full.numel()
    return torch.sub(x, target).mul_(norm).mul_(grad)


@register_rule(aten.mse_loss_backward.default, family="backward", kernel=_mse_backward_kernel)
def mse_loss_backward(call: OpCall) -> list[PlacementSignature]:
    """``self``/``target`` sharded alike (``grad_output`` too when unreduced) -> ``S(d)``; linear in
    ``grad_output``."""
    grad, x, target = call.inputs
    assert grad is not None and x is not None and target is not None
    if int(call.arg("reduction", REDUCTION_MEAN)) == REDUCTION_NONE:
        shapes: list[tuple[int, ...] | None] = [tuple(grad.shape), tuple(x.shape), tuple(target.shape)]
        sigs = broadcast_shard_signatures(shapes, call.out_meta[0].shape)
    else:
        base = broadcast_shard_signatures([tuple(x.shape), tuple(target.shape)], call.out_meta[0].shape)
        sigs = [sig([_R, *s.inputs], s.outputs) for s in base]
    sigs.append(_partial_grad_signature(call))
    return sigs
