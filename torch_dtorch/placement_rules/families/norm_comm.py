"""Communicating kernels for the reductions whose shards do not combine into a Partial: p-norms and ``prod``.

A p-norm over a sharded dim is ``(Σ_r Σ|x|^p)^(1/p)``: the cross-rank sum needs a root after it, which no Partial
placement expresses (upstream DTensor has its own ``_NormPartial``); a product over a sharded dim would need a
``Partial("prod")``, which dtorch's placements and collectives do not carry. Rather than gather the input, these
rules add, for every reduced dim ``d``, the signature (one mesh axis)::

    S(d) -> R

whose local kernel communicates (``register_comm_kernel``: eager workers hand it their communicator, compiled
graphs run it as a comm kernel step). The call's **comm axes** are the mesh axes of size > 1 on which the input is
``Shard(d)`` for a reduced ``d``; the devices that differ from this rank only on those axes form its group (several
axes — a dim sharded by two nested axes, or two reduced dims — make one group). On every rank:

1. reduce the local shard: ``Σ|x|^p`` over the reduced dims (on ``x.to(dtype)`` when ``dtype=`` is given; the real
   ``|x|`` of complex inputs; float32 for half inputs), or ``Π x`` (in the output dtype, float32 for half);
2. exchange that partial result with the group point-to-point (``context_parallel.exchange``): only the reduced
   tensor — this rank's output block — travels, never the input;
3. combine the partials in group order (sum or product: every member uses the same order, so the replicas are
   bit-identical) and, for a norm, take the ``1/p`` root (``sqrt`` for ``p = 2``); cast to the output dtype.

Everything else is as in ``reduction.py``: kept dims stay sharded (``S(d) -> S(d')``), so a kept dim sharded on one
axis composes with a reduced dim sharded on another; norms of order 0, 1 and ±inf keep their Partial signature
(their kernel does not communicate). A rank whose shard of a reduced dim is empty contributes the identity (``0`` or
``1``). Where no axis of size > 1 shards a reduced dim (a 1-device mesh, Replicate inputs) the kernel is the op
itself, bit-identical to torch. A Partial input is moved to the cheapest signature: reduce-scattered onto a dim
(kept or reduced), which is cheaper than all-reducing it.

Cost: the elementwise model, plus in ``comm_bytes`` the exchange for the call's placements (every device receives
``group - 1`` output blocks). The matcher needs no cost to prefer the exchange over gathering: an input sharded on a
reduced dim matches ``S(d) -> R`` exactly, and an exact match is taken before any redistribute is priced.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.graph import OperatorCost
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.ops.cost import meta_nbytes
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.context_parallel import device_comm, exchange, register_comm_kernel
from torch_dtorch.placement_rules.families.reduction import ReductionRule, VectorNormRule
from torch_dtorch.placement_rules.rule import get_rule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["NORM_TAG", "CommReductionRule", "comm_group"]

aten = torch.ops.aten
_R = Replicate()
#: point-to-point tag of the partial results exchanged by these kernels
NORM_TAG = 0x6E72


def comm_group(mesh: DeviceMesh, coordinate: Sequence[int], axes: Sequence[int]) -> tuple[list[int], int]:
    """Device ids of the ranks that differ from ``coordinate`` only on ``axes`` (sorted by coordinate), and the
    index of ``coordinate`` among them."""
    members = [tuple(coordinate)]
    for a in axes:
        members = [(*c[:a], i, *c[a + 1 :]) for c in members for i in range(mesh.shape[a])]
    members.sort()
    ids = mesh.mesh
    return [int(ids[c]) for c in members], members.index(tuple(coordinate))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where partial results are computed and combined: float32 for half types, else ``dtype`` itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class CommReductionRule(ReductionRule):
    """A reduction with ``S(d) -> R`` for every reduced dim ``d`` (where :meth:`communicates`), whose kernel
    reduces the shard, exchanges the partial results over the comm axes and combines them."""

    # --- hooks of the concrete reductions -------------------------------------------------------------------------
    def communicates(self, call: OpCall) -> bool:
        """Whether this call gets the communicating signature (norms of order 0, 1, ±inf have a Partial instead)."""
        return True

    def local_partial(self, call: OpCall, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
        """This rank's partial result over the reduced dims (abstract)."""
        raise NotImplementedError(f"{type(self).__name__}.local_partial")

    def combine(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        """The group's partial results (in group order) combined into one (abstract)."""
        raise NotImplementedError(f"{type(self).__name__}.combine")

    def finish(self, call: OpCall, total: torch.Tensor) -> torch.Tensor:
        """The output block from the combined partials (default: cast to the output dtype)."""
        return total.to(call.out_meta[0].dtype)

    # --- the rule ---------------------------------------------------------------------------------------------------
    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        """The reduction's signatures, then ``S(d) -> R`` per reduced dim (after all-Replicate: on a cost tie, a
        Partial input is reduce-scattered onto a kept dim, which needs no exchange)."""
        sigs = list(super().signatures(call))
        x = call.inputs[0]
        if x is not None and x.ndim and self.communicates(call):
            dims, _ = self.dims(call)
            sigs += [sig([Shard(d)], [_R] * call.num_outputs) for d in dims]
        return sigs

    def comm_axes(self, call: OpCall) -> list[int]:
        """Mesh axes of size > 1 on which the input is sharded on a reduced dim (``call.placements`` are the matched
        signature's inputs where the runtime calls the kernel)."""
        x, pl, mesh = call.inputs[0], call.placements[0], call.mesh
        if x is None or pl is None or mesh is None or not x.ndim or not self.communicates(call):
            return []
        dims, _ = self.dims(call)
        return [
            a
            for a, p in enumerate(pl)
            if mesh.shape[a] > 1 and isinstance(p, Shard) and p.dim % x.ndim in dims
        ]

    def _kernel_is_op_on(self, call: OpCall, ctx: LocalContext) -> bool:
        """Without a comm axis, and with a non-empty shard (an empty one may get the identity: ``_Extremum``), the
        kernel is the op itself: workers replay it."""
        local = ctx.in_shapes[0]
        return (
            type(self).kernel is CommReductionRule.kernel
            and local is not None
            and math.prod(local) > 0
            and not self.comm_axes(call)
        )

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The op itself where no comm axis exists; otherwise local partial, exchange over the group, combine."""
        axes = self.comm_axes(call)
        if not axes:
            return super().kernel(call, ctx, args, kwargs)
        assert call.mesh is not None
        comm = device_comm(ctx, what=f"{call.op} over a sharded reduced dim")
        dims, keepdim = self.dims(call)
        part = self.local_partial(call, args[0], dims, keepdim)
        devices, me = comm_group(call.mesh, ctx.coordinate, axes)
        parts = exchange(comm, devices, me, [part] * len(devices), tag=NORM_TAG)
        return self.finish(call, self.combine([p.to(part.device) for p in parts]))

    def cost(self, call: OpCall) -> OperatorCost:
        """Elementwise cost; ``comm_bytes``: every device receives ``group - 1`` output blocks."""
        base = super().cost(call)
        axes = self.comm_axes(call)
        x, pl, mesh = call.inputs[0], call.placements[0], call.mesh
        if not axes or x is None or pl is None or mesh is None:
            return base
        dims, _ = self.dims(call)
        group = math.prod(mesh.shape[a] for a in axes)
        kept_split = math.prod(
            mesh.shape[a] for a, p in enumerate(pl) if isinstance(p, Shard) and p.dim % x.ndim not in dims
        )
        block = math.ceil(sum(meta_nbytes(m) for m in call.out_meta) / kept_split)
        return dataclasses.replace(base, comm_bytes=base.comm_bytes + mesh.size() * (group - 1) * block)


@register_rule(aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim, family="reduction")
class _VectorNorm(CommReductionRule, VectorNormRule):
    """p-norms (``p`` not 0, 1, ±inf) over a sharded dim: ``(Σ_group Σ|x|^p)^(1/p)``, Replicate on the comm axes."""

    def communicates(self, call: OpCall) -> bool:
        return self.sharded_op(call) is None

    def local_partial(self, call: OpCall, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
        dtype = call.arg("dtype")
        if dtype is not None:
            x = x.to(dtype)
        p = self.order(call)
        a = x.abs().to(_acc_dtype(call.out_meta[0].dtype))
        return torch.sum(a * a if p == 2 else a.pow(p), dim=dims, keepdim=keepdim)

    def combine(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(parts)).sum(0)

    def finish(self, call: OpCall, total: torch.Tensor) -> torch.Tensor:
        p = self.order(call)
        return super().finish(call, total.sqrt() if p == 2 else total.pow(1.0 / p))


@register_rule(aten.prod.default, aten.prod.dim_int, family="reduction")
class _Prod(CommReductionRule):
    """``prod`` over a sharded dim: the product of the group's local products, Replicate on the comm axes."""

    def local_partial(self, call: OpCall, x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
        acc = _acc_dtype(call.out_meta[0].dtype)
        if call.op is aten.prod.dim_int:
            return torch.prod(x, dims[0], keepdim=keepdim, dtype=acc)
        return torch.prod(x, dtype=acc)

    def combine(self, parts: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.stack(list(parts)).prod(0)


def _needs_comm(call: OpCall) -> bool:
    rule = get_rule(call.op)
    return isinstance(rule, CommReductionRule) and bool(rule.comm_axes(call))


for _op in (aten.linalg_vector_norm.default, aten.norm.ScalarOpt_dim, aten.prod.default, aten.prod.dim_int):
    register_comm_kernel(_op, _needs_comm)
