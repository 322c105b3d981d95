"""Misc family: copies and conversions, fill, dropout, native_dropout, one_hot.

Signatures (one mesh axis):

- ``clone``, ``contiguous``, ``_to_copy``, ``to.dtype``/``to.dtype_layout``/``to.device``: ``S(d) -> S(d)``;
  ``P -> P`` (every reduce op) for a plain copy and for a cast between floating dtypes (rounding is monotonic, so
  max/min stay exact and sum/avg differ only by rounding, as with any reordered float sum). A cast to an integer or
  bool dtype is not linear (truncation, ``!= 0``): a Partial input is reduced first.
- ``to.other``, ``type_as``: like ``to.dtype`` with ``other``'s dtype; ``other`` lends only its dtype, so it keeps
  whatever placement it has (never redistributed).
- ``copy(self, src)`` (functional ``copy_``): the output has ``self``'s shape and dtype and ``src``'s values:
  ``self`` ``S(d)`` with ``src`` ``S(aligned)`` or ``R`` when broadcast -> ``S(d)``; ``src`` Partial -> Partial (cast
  rule above) with ``self`` ``R`` or the same Partial; ``self`` Partial with ``src`` ``R`` -> ``R`` (``self``'s values
  are overwritten).
- ``fill.Scalar``, ``fill.Tensor`` (value ``R``): ``S(d) -> S(d)``; no Partial (every part filled with ``v`` would
  reduce to ``n·v``).
- ``dropout``: ``S(d) -> S(d)``, ``P(sum|avg) -> P(sum|avg)`` (with one global mask dropout is linear in the input;
  without training it is the identity). With ``train=True`` and ``0 < p < 1`` every rank draws the GLOBAL noise
  tensor exactly as CPU torch does (``empty_like(input).bernoulli_(1 - p).div_(1 - p)``) from the shared generator
  state (:func:`~torch_dtorch.placement_rules.families.creation.draw_global`; O(global numel) per rank) and multiplies its
  slice, so results and the generator state equal single-device CPU torch under the same seed (where the workers
  draw from the controller's generator: thread mode; worker processes follow it only from the last seed, see
  ``device/worker_rng.py``).
- ``native_dropout`` (``(output, mask)``; what torch's decomposition of ``dropout`` calls for accelerator tensors,
  and what ``torch.compile`` captures for ``F.dropout`` in training): ``S(d) -> S(d), S(d)``,
  ``P(sum|avg) -> P, R``. It draws CPU torch's ``native_dropout`` mask (the global
  ``empty_like(input).bernoulli_(1 - p)``, same generator use as ``dropout``) and returns
  ``input.mul(mask).mul_(1 / (1 - p))`` as CPU's kernel does — equal to CPU ``torch.native_dropout`` bit for bit;
  equal to CPU ``F.dropout`` (which scales by ``noise.div_(1 - p)`` in float32) where ``float32(1 / (1 - p))`` equals
  ``1 / float32(1 - p)`` (``p = 0.1``, ``0.2``, ``0.5`` do; ``p = 0.025`` does not: 1 ulp).
- Eager calls of both do not draw here: ``device/dropout.py`` draws their noise on the controller (in process mode
  the workers' generators are not the controller's) and records pointwise ops; what reaches these kernels is
  compiled programs, the calls that draw nothing (``train=False``, ``p = 0`` / ``1`` of ``dropout``, empty inputs)
  and the plain-torch simulator. The noise has ``empty_like(input)``'s layout (preserve format), as in torch.
- ``one_hot(num_classes)``: ``S(d) -> S(d)`` for the input dims. ``num_classes=-1`` (the global max + 1, a
  data-dependent size) raises ``NotImplementedError``.

Composite (CompositeImplicitAutograd) overloads are intercepted: ``to.*``, ``contiguous``, ``type_as``, ``dropout``,
``one_hot``. ``to.*``/``contiguous``/``type_as`` return ``self`` itself when nothing changes, locally as in torch;
the eager kernel must alias the operand in that case.

Devices: a ``device`` argument names the ``dtorch`` device (moving a ``dtorch`` tensor to another device is a
conversion the front end handles before any rule). Shape inference runs with ``device='meta'``; locally a ``device``
keyword is dropped (``None`` keeps the shard's device) and ``to.device``'s positional device becomes the local
shard's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from torch_dtorch.errors import ShapeError
from torch_dtorch.graph import TensorMeta
from torch_dtorch.placement import PARTIAL_OPS, Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.creation import draw_global, local_kwargs, rank_slice
from torch_dtorch.placement_rules.families.pointwise import broadcast_shard_signatures
from torch_dtorch.placement_rules.growth import copy_grown_meta, elementwise_growth_key
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["CopyRule", "cast_keeps_partial", "copy_signatures"]

aten = torch.ops.aten
_R = Replicate()


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def cast_keeps_partial(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether a Partial value cast from ``src`` to ``dst`` is still a Partial of the cast value."""
    return src == dst or (_is_float(src) and _is_float(dst))


def copy_signatures(call: OpCall, extra: Sequence[Sequence[Placement]] = ((),)) -> list[PlacementSignature]:
    """Input 0 ``S(d) -> S(d)`` and (cast rule) ``P -> P``; ``extra`` lists placements of the trailing slots."""
    x = call.inputs[0]
    assert x is not None
    sigs = []
    for rest in extra:
        sigs += [sig([Shard(d), *rest], Shard(d)) for d in range(x.ndim)]
        if cast_keeps_partial(x.dtype, call.out_meta[0].dtype):
            sigs += [sig([Partial(op), *rest], Partial(op)) for op in PARTIAL_OPS]
    return sigs


def _current(call: OpCall, slot: int) -> list[Placement]:
    """``R`` and the placements slot ``slot`` currently has on any mesh axis (for slots lending only metadata)."""
    found = {p for p in call.placements[slot] or () if p != _R}
    return [_R, *sorted(found, key=str)]


class CopyRule(OpRule):
    """A copy or conversion of input 0; ``device`` arguments are the ``dtorch`` device (see the module docstring)."""

    family = "misc"

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        extra = [[q] for q in _current(call, 1)] if len(call.inputs) > 1 else [[]]
        return copy_signatures(call, extra)

    def infer_meta(self, call: OpCall) -> list[TensorMeta]:
        if "device" in call.kwargs:
            return super().infer_meta(
                replace(call, kwargs={**call.kwargs, "device": torch.device("meta")}, _bound=None)
            )
        if call.op is aten.to.device and len(call.args) > 1:
            args = (call.args[0], torch.device("meta"), *call.args[2:])
            return super().infer_meta(replace(call, args=args, _bound=None))
        return super().infer_meta(call)

    def localize(self, call: OpCall, ctx: LocalContext) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args = call.args
        if call.op is aten.to.device and len(args) > 1:  # the rank's device (where a worker's shards live)
            args = (args[0], ctx.torch_device or torch.device("cpu"), *args[2:])
        return args, local_kwargs(call.kwargs)

    def kernel_is_op(self, op: Any) -> bool:
        return op is not aten.to.device and "kernel" not in vars(self)  # to.device names the rank's device

    def may_run_op_as_is(self, op: Any) -> bool:
        return "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        """Also ``to.device`` with a positional device: :meth:`localize` names the worker's device."""
        return "kernel" not in vars(self) and (call.op is not aten.to.device or len(call.args) > 1)

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if call.op is aten.to.device:
            if len(args) > 1:
                args = (args[0], args[0].device, *args[2:])
            else:
                kwargs = {**kwargs, "device": args[0].device}
        return call.op(*args, **kwargs)


@register_rule(aten.clone.default, aten._to_copy.default, aten.lift_fresh_copy.default, family="misc")
class _Copy(CopyRule):
    """A fresh copy (optionally cast). Shape-generic (``placement_rules/growth.py``): a contiguous input's copy
    is derived at new lengths (``generate``'s clone of the growing ``input_ids``)."""

    def growth_key(self, call: OpCall) -> Any:
        return elementwise_growth_key(call)

    def grown_meta(self, call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
        return copy_grown_meta(call, kept)


@register_rule(
    aten.contiguous.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
    aten.type_as.default, family="misc", intercept=True,
)  # fmt: skip
class _To(CopyRule):
    """Composite conversions: intercepted so that placements are kept (they return ``self`` when nothing changes)."""


@register_rule(aten.copy.default, family="misc")
def copy(call: OpCall) -> list[PlacementSignature]:
    """``self``'s layout with ``src``'s values (broadcast)."""
    self_, src = call.inputs
    assert self_ is not None and src is not None
    sigs = broadcast_shard_signatures([self_.shape, src.shape], call.out_meta[0].shape)
    if cast_keeps_partial(src.dtype, self_.dtype):
        for op in PARTIAL_OPS:
            p = Partial(op)
            sigs += [sig([_R, p], p), sig([p, p], p)]
    sigs += [sig([Partial(op), _R], _R) for op in PARTIAL_OPS]
    return sigs


@register_rule(aten.fill.Scalar, aten.fill.Tensor, family="misc")
def fill(call: OpCall) -> list[PlacementSignature]:
    """``S(d) -> S(d)`` (the value, a 0-d tensor for ``fill.Tensor``, is Replicate); no Partial."""
    x = call.inputs[0]
    assert x is not None
    value = [_R] * (len(call.inputs) - 1)
    return [sig([Shard(d), *value], Shard(d)) for d in range(x.ndim)]


def _empty_like(x: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty_like`` of the global operand ``x`` (its shape and preserve-format strides) on ``device``."""
    like = torch.empty_strided(x.shape, x.stride or (), dtype=dtype, device="meta")
    return torch.empty_like(like, device=device)


def _dropout_draws(call: OpCall) -> bool:
    """Whether the call draws random numbers (training with ``0 < p < 1``); otherwise it is the op itself."""
    x, p = call.arg("input"), float(call.arg("p"))
    return bool(call.arg("train")) and 0 < p < 1 and x.numel() != 0


def _dropout_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, p = call.arg("input"), float(call.arg("p"))
    local = args[0]
    if not _dropout_draws(call):
        return call.op(*args, **kwargs)  # no random numbers are drawn

    def draw(gen: torch.Generator) -> torch.Tensor:
        return _empty_like(x, x.dtype, local.device).bernoulli_(1 - p, generator=gen)

    # the output has the input's placements: the rank's block of the output is its block of the input
    return local * rank_slice(draw_global(call, ctx, draw), ctx).div_(1 - p)


def _native_dropout_draws(call: OpCall) -> bool:
    """Whether ``native_dropout`` draws (CPU torch's kernel draws whenever ``train`` is not ``False``)."""
    train = call.arg("train")
    x = call.inputs[0]
    assert x is not None
    return (train is None or bool(train)) and x.numel() != 0


def _native_dropout_kernel(
    call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """CPU torch's ``native_dropout``: ``mask = empty_like(x).bernoulli_(1 - p)`` (the global draw),
    ``out = x.mul(mask).mul_(1 / (1 - p))``, the mask returned as ``bool``."""
    x, p = call.arg("input"), float(call.arg("p"))
    local = args[0]
    if not _native_dropout_draws(call):
        # (torch returns a mask of the input's dtype for an empty input: an empty shard must still give bool)
        out, mask = call.op(*args, **kwargs)
        return out, mask.to(call.out_meta[1].dtype)

    def draw(gen: torch.Generator) -> torch.Tensor:
        return _empty_like(x, torch.bool, local.device).bernoulli_(1 - p, generator=gen)

    mask = rank_slice(draw_global(call, ctx, draw), ctx, 1)
    scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
    return local.mul(mask).mul_(scale), mask


def _check_dropout(call: OpCall) -> None:
    p = float(call.arg("p"))
    if not 0 <= p <= 1:
        raise ShapeError(f"{call.op}: dropout probability has to be between 0 and 1, but got {p}")


@register_rule(
    aten.dropout.default,
    family="misc",
    intercept=True,
    kernel=_dropout_kernel,
    as_is=lambda call: not _dropout_draws(call),  # workers replay it without training
    check=_check_dropout,
)
def dropout(call: OpCall) -> list[PlacementSignature]:
    """Shards kept; ``P(sum|avg)`` kept (one global mask makes dropout linear in its input)."""
    x = call.inputs[0]
    assert x is not None
    return [sig([Shard(d)], Shard(d)) for d in range(x.ndim)] + [
        sig([Partial(op)], Partial(op)) for op in ("sum", "avg")
    ]


@register_rule(
    aten.native_dropout.default,
    family="misc",
    kernel=_native_dropout_kernel,
    check=_check_dropout,
)
def native_dropout(call: OpCall) -> list[PlacementSignature]:
    """``(output, mask)``: ``S(d) -> S(d), S(d)``; ``P(sum|avg) -> P, R`` (the mask is the whole global draw)."""
    x = call.inputs[0]
    assert x is not None
    return [sig([Shard(d)], [Shard(d), Shard(d)]) for d in range(x.ndim)] + [
        sig([Partial(op)], [Partial(op), _R]) for op in ("sum", "avg")
    ]


def _check_one_hot(call: OpCall) -> None:
    if call.arg("num_classes") is None or int(call.arg("num_classes")) < 0:
        raise NotImplementedError(
            f"{call.op}: num_classes=-1 needs the global maximum of the input (a data-dependent output size, a "
            "sync); pass num_classes explicitly"
        )


@register_rule(aten.one_hot.default, family="misc", intercept=True, check=_check_one_hot)
def one_hot(call: OpCall) -> list[PlacementSignature]:
    """``S(d) -> S(d)`` for every input dim (the new class dim is whole on every rank)."""
    x = call.inputs[0]
    assert x is not None
    return [sig([Shard(d)], Shard(d)) for d in range(x.ndim)]
