"""Reduction family: sum, mean, amax/amin, max/min (full and ``.dim``), argmax/argmin, var/std/var_mean, prod,
any/all, logsumexp, the vector norms ``linalg_vector_norm`` / ``norm.ScalarOpt_dim``, and the scan ``cumsum``.

Signatures (one mesh axis), for an input whose reduced dims are ``D`` (``dim=None`` and, except for ``any.dims`` /
``all.dims``, an empty dim list mean every dim):

- kept dim ``d`` (not in ``D``): ``S(d) -> S(d')`` for every output (values and indices alike), where ``d' = d`` with
  ``keepdim=True`` and ``d`` minus the reduced dims before it otherwise.
- reduced dim ``d`` (in ``D``), only where the reduction decomposes over shards:
  ``sum -> P(sum)``; ``mean -> P(sum)`` (the kernel divides the local sum by the GLOBAL element count, so uneven
  shards are exact); ``amax``/``max`` and ``any`` ``-> P(max)``; ``amin``/``min`` and ``all`` ``-> P(min)``; the
  vector norms whose combination over shards is one of those reductions, with nothing to finish after it:
  ``ord`` 1 (``Σ|x|``) and 0 (the count of non-zeros) ``-> P(sum)``, ``inf`` (``max|x|``) ``-> P(max)``, ``-inf``
  ``-> P(min)``. A rank whose shard of a reduced dim is empty returns the reduction's identity (``-inf`` for max,
  ``False`` for any, ``0`` for a norm's sum or max, ...).
- Partial inputs: ``sum``/``mean``/``cumsum`` are linear: ``P(sum) -> P(sum)`` and ``P(avg) -> P(avg)`` (floating
  input and output only: a cast to an integer dtype is not linear); ``amax``/``max``: ``P(max) -> P(max)``;
  ``amin``/``min``: ``P(min) -> P(min)``. Every other Partial input is reduced first.
- no signature for a sharded reduced dim (the matcher all-gathers that dim first): ``max.dim``/``min.dim`` (values
  and global indices), ``argmax``/``argmin``, ``var``/``std``/``var_mean`` and ``logsumexp``. Full reductions of
  these (``argmax`` without ``dim``) are therefore Replicate only.
- ``prod`` (it would need a ``Partial("prod")``, which dtorch's placements and collectives do not carry) and the
  vector norms of any other ``ord`` (``2``, ``p``: ``(Σ_r Σ|x|^p)^(1/p)`` needs a root after the cross-rank sum,
  which no Partial expresses): ``S(d) -> R`` for a reduced ``d``, with a local kernel that communicates (local
  partial result, point-to-point exchange over the sharding axes, combine, root). Their rules live in
  ``norm_comm.py``, built on :class:`VectorNormRule` and :class:`ReductionRule` here.
- ``cumsum(dim)``: ``S(d) -> S(d)`` for ``d != dim``; ``P(sum|avg) -> P(sum|avg)`` for floating dtypes.

All-Replicate is listed before the Partial pass-through signatures: an input that must move anyway (e.g. a
sharded scanned dim) is gathered rather than turned into a zero-filled Partial, which costs the same to reach.
A rank whose output block is empty (an empty shard of a kept dim) skips the op.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.placement import Partial, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import OpRule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, all_replicate, sig

__all__ = ["ReductionRule", "VectorNormRule", "norm_partial", "reduced_dims", "reduction_signatures"]

aten = torch.ops.aten
_LINEAR = ("sum", "avg")


def _is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def reduced_dims(call: OpCall, *, empty_means_all: bool = True) -> tuple[list[int], bool]:
    """Sorted non-negative reduced dims of input 0 and ``keepdim``, from the call's ``dim``/``keepdim`` arguments."""
    x = call.inputs[0]
    assert x is not None
    ndim = x.ndim
    dim = call.arg("dim")
    if dim is None:
        dims: Sequence[int] = range(ndim)
    elif isinstance(dim, int):
        dims = [dim]
    else:
        dims = list(dim) if (dim or not empty_means_all) else range(ndim)
    norm = sorted({d % ndim for d in dims}) if ndim else []
    return norm, bool(call.arg("keepdim", False))


def reduction_signatures(
    call: OpCall,
    dims: Sequence[int],
    keepdim: bool,
    *,
    sharded: str | None = None,
    partials: Sequence[str] = (),
) -> list[PlacementSignature]:
    """Kept dims stay sharded; a sharded reduced dim gives ``P(sharded)``; ``P(p) -> P(p)`` for ``p`` in partials."""
    x = call.inputs[0]
    assert x is not None
    n_out = call.num_outputs
    sigs: list[PlacementSignature] = []
    for d in range(x.ndim):
        if d not in dims:
            out_d = d if keepdim else d - sum(1 for r in dims if r < d)
            sigs.append(sig([Shard(d)], [Shard(out_d)] * n_out))
        elif sharded is not None:
            sigs.append(sig([Shard(d)], [Partial(sharded)] * n_out))
    sigs.append(all_replicate(1, n_out))  # before the Partials: on a cost tie, gather rather than zero-fill
    linear_ok = _is_float(x.dtype) and all(_is_float(m.dtype) for m in call.out_meta)
    for p in partials:
        if p not in _LINEAR or linear_ok:
            sigs.append(sig([Partial(p)], [Partial(p)] * n_out))
    return sigs


def _identity(reduce_op: str, dtype: torch.dtype) -> bool | int | float:
    """The value a rank with nothing to reduce contributes to ``Partial(reduce_op)`` (``max`` or ``min``)."""
    if dtype == torch.bool:
        return reduce_op == "min"
    if dtype.is_floating_point:
        return math.inf if reduce_op == "min" else -math.inf
    info = torch.iinfo(dtype)
    return info.max if reduce_op == "min" else info.min


class ReductionRule(OpRule):
    """A reduction over ``dim`` of input 0. Subclasses set what a sharded reduced dim and Partial inputs give."""

    family = "reduction"
    #: Partial reduce op produced when a reduced dim is sharded (None: no such signature, the dim is gathered)
    sharded: str | None = None
    #: Partial reduce ops of the input that pass through to the outputs
    partials: tuple[str, ...] = ()
    #: an empty dim list reduces every dim (False for ``any.dims``/``all.dims``, where it reduces none)
    empty_means_all: bool = True

    def dims(self, call: OpCall) -> tuple[list[int], bool]:
        return reduced_dims(call, empty_means_all=self.empty_means_all)

    def sharded_op(self, call: OpCall) -> str | None:
        """The Partial reduce op a sharded reduced dim gives for this call (default: :attr:`sharded`)."""
        return self.sharded

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        dims, keepdim = self.dims(call)
        return reduction_signatures(
            call, dims, keepdim, sharded=self.sharded_op(call), partials=self.partials
        )

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The op on the shard; a rank whose output block is empty (an empty shard of a kept dim) skips it (torch
        would warn, e.g. about var's degrees of freedom, on every such rank)."""
        if any(math.prod(s) == 0 for s in ctx.out_shapes):
            dev = args[0].device
            outs = [torch.empty(s, dtype=m.dtype, device=dev) for s, m in zip(ctx.out_shapes, call.out_meta)]
            return tuple(outs) if len(outs) > 1 else outs[0]
        return call.op(*args, **kwargs)

    def may_run_op_as_is(self, op: Any) -> bool:
        return "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        """The kernel is the op itself unless the rank's output block is empty; subclasses with their own kernel
        say when theirs is (:meth:`_kernel_is_op_on`)."""
        if "kernel" in vars(self) or any(math.prod(s) == 0 for s in ctx.out_shapes):
            return False
        return self._kernel_is_op_on(call, ctx)

    def _kernel_is_op_on(self, call: OpCall, ctx: LocalContext) -> bool:
        return type(self).kernel is ReductionRule.kernel

    def _whole_on_rank(self, call: OpCall, ctx: LocalContext) -> bool:
        """The rank holds every element of the reduced dims (:meth:`_local_is_whole` from the plan's shapes)."""
        src, local = call.inputs[0], ctx.in_shapes[0]
        assert src is not None and local is not None
        return all(local[d] == src.shape[d] for d in self.dims(call)[0])

    def _local_is_whole(self, call: OpCall, x: torch.Tensor) -> tuple[bool, list[int], bool]:
        """Whether this rank holds every element of the reduced dims (then the op runs unchanged)."""
        dims, keepdim = self.dims(call)
        src = call.inputs[0]
        assert src is not None
        return all(x.shape[d] == src.shape[d] for d in dims), dims, keepdim


@register_rule(aten.sum.default, aten.sum.dim_IntList, family="reduction")
class _Sum(ReductionRule):
    sharded = "sum"
    partials = _LINEAR


@register_rule(aten.mean.default, aten.mean.dim, family="reduction")
class _Mean(ReductionRule):
    sharded = "sum"
    partials = _LINEAR

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A shard of a reduced dim contributes ``local_sum / global_count`` (exact with uneven shards)."""
        x = args[0]
        whole, dims, keepdim = self._local_is_whole(call, x)
        if whole:
            return super().kernel(call, ctx, args, kwargs)
        src = call.inputs[0]
        assert src is not None
        count = math.prod(src.shape[d] for d in dims)
        return torch.sum(x, dim=dims, keepdim=keepdim, dtype=call.out_meta[0].dtype).div_(count)

    def _kernel_is_op_on(self, call: OpCall, ctx: LocalContext) -> bool:
        return type(self).kernel is _Mean.kernel and self._whole_on_rank(call, ctx)


class _Extremum(ReductionRule):
    """amax/amin/max/min/any/all: a rank with an empty shard of a reduced dim contributes the identity."""

    def identity(self, reduce_op: str, dtype: torch.dtype) -> bool | int | float:
        return _identity(reduce_op, dtype)

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0]
        reduce_op = self.sharded_op(call)
        if x.numel() == 0 and reduce_op is not None and not self._local_is_whole(call, x)[0]:
            dtype = call.out_meta[0].dtype
            fill = self.identity(reduce_op, dtype)
            return torch.full(ctx.out_shapes[0], fill, dtype=dtype, device=x.device)
        return super().kernel(call, ctx, args, kwargs)

    def _kernel_is_op_on(self, call: OpCall, ctx: LocalContext) -> bool:
        local = ctx.in_shapes[0]
        empty = local is not None and math.prod(local) == 0
        return type(self).kernel is _Extremum.kernel and (not empty or self._whole_on_rank(call, ctx))


@register_rule(aten.amax.default, aten.max.default, family="reduction")
class _Max(_Extremum):
    sharded = "max"
    partials = ("max",)


@register_rule(aten.amin.default, aten.min.default, family="reduction")
class _Min(_Extremum):
    sharded = "min"
    partials = ("min",)


@register_rule(aten.any.default, aten.any.dim, family="reduction")
class _Any(_Extremum):
    sharded = "max"


@register_rule(aten.all.default, aten.all.dim, family="reduction")
class _All(_Extremum):
    sharded = "min"


@register_rule(aten.any.dims, family="reduction")
class _AnyDims(_Any):
    empty_means_all = False


@register_rule(aten.all.dims, family="reduction")
class _AllDims(_All):
    empty_means_all = False


LOCAL_OPS = [
    aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.var.correction,
    aten.std.correction, aten.var_mean.correction, aten.logsumexp.default,
]  # fmt: skip


@register_rule(*LOCAL_OPS, family="reduction")
class _Local(ReductionRule):
    """Reductions that are not a Partial of their shards: only kept dims stay sharded."""


def norm_partial(order: float | None) -> str | None:
    """How per-shard ``order``-norms combine over a sharded reduced dim: a Partial reduce op, or None where they do not
    (every ``ord`` but 0, 1 and ±inf needs a root after the cross-rank sum)."""
    p = 2.0 if order is None else float(order)
    if p in (0.0, 1.0):
        return "sum"
    if p == math.inf:
        return "max"
    if p == -math.inf:
        return "min"
    return None


class VectorNormRule(_Extremum):
    """``linalg_vector_norm(x, ord, dim)`` and ``norm.ScalarOpt_dim(x, p, dim)`` (``p=None``: 2): kept dims stay
    sharded; a sharded reduced dim gives :func:`norm_partial` of the order. Not linear: no Partial input.
    Registered by ``norm_comm.py``, which adds the communicating signature of the other orders."""

    def order(self, call: OpCall) -> float:
        """The norm's order (``2`` where the call leaves it out)."""
        order = call.arg("ord", 2) if call.op is aten.linalg_vector_norm.default else call.arg("p")
        return 2.0 if order is None else float(order)

    def sharded_op(self, call: OpCall) -> str | None:
        return norm_partial(self.order(call))

    def identity(self, reduce_op: str, dtype: torch.dtype) -> bool | int | float:
        """Norms are non-negative: ``0`` is the identity of their sum and max (``inf`` of their min)."""
        return math.inf if reduce_op == "min" else 0.0


@register_rule(aten.cumsum.default, family="reduction")
def cumsum(call: OpCall) -> list[PlacementSignature]:
    """Scan along ``dim``: every other dim stays sharded; linear in a ``P(sum|avg)`` input."""
    x = call.inputs[0]
    assert x is not None
    dim = call.arg("dim") % max(x.ndim, 1)
    sigs = [sig([Shard(d)], Shard(d)) for d in range(x.ndim) if d != dim] + [all_replicate(1, 1)]
    if _is_float(x.dtype) and _is_float(call.out_meta[0].dtype):
        sigs += [sig([Partial(p)], Partial(p)) for p in _LINEAR]
    return sigs
