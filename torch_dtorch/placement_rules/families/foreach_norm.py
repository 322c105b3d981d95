"""``_foreach_norm``: the norms of a whole list in one communicating operator (``clip_grad_norm_``'s first step).

Each element keeps its placement (a ``Partial`` element is reduced first: a norm is not linear) and every output
is a ``Replicate`` 0-d tensor. On every rank the kernel

1. computes, for each element sharded on some mesh axis of size > 1 (its **comm axes**), the local partial — ``Σ|x|^p``
   (``p`` finite, in float32 for half types) or ``max|x|`` (``p = inf``), ``0`` for an empty shard;
2. groups those elements by their comm axes and, per group, exchanges **one** stacked vector of partials with the
   ranks that differ only on those axes (``norm_comm.comm_group``) — one message per peer for the whole list, where
   the per-tensor path exchanged once per tensor;
3. combines the partials in group order (sum, or max for ``inf``; the replicas are bit-identical) and takes the
   ``1/p`` root;

and runs the op itself on the elements that have no comm axis (replicated ones: bit-identical to torch). Orders other
than finite ``p > 0`` and ``inf`` run op by op (the per-tensor ``linalg_vector_norm`` rules).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.errors import PlacementMismatchError
from torch_dtorch.placement import Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.comm import device_comm, exchange, register_comm_kernel
from torch_dtorch.placement_rules.families.norm_comm import comm_group
from torch_dtorch.placement_rules.rule import OpRule, get_rule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature

__all__ = ["ForeachNormRule"]

aten = torch.ops.aten
_R = Replicate()
#: point-to-point tags of the exchanges (one per group of elements with the same comm axes)
FOREACH_NORM_TAG = 0x6600


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_rule(aten._foreach_norm.Scalar, family="foreach")
class ForeachNormRule(OpRule):
    """The list rule of ``_foreach_norm`` (see the module docstring)."""

    op_by_op_fallback = True
    auto_replicate = False

    def constants_key(self, call: OpCall) -> Any:
        return (self.order(call), call.arg("dtype"))

    @staticmethod
    def order(call: OpCall) -> float:
        return float(call.arg("ord", 2))

    def signatures(self, call: OpCall) -> Sequence[PlacementSignature]:
        p = self.order(call)
        if not (p == math.inf or (math.isfinite(p) and p > 0)):
            raise PlacementMismatchError(
                call.op,
                arguments=[f"ord={p}"],
                axis=0,
                signatures=[],
                reason=f"the list rule covers finite orders > 0 and inf, not {p}",
                fix="none needed: the norms run op by op",
            )
        sigs = []
        for axis in range(call.mesh_ndim):
            ins: list[Placement] = []
            for pl in call.placements:
                q = (pl or ())[axis] if pl else _R
                ins.append(q if type(q) is Shard else _R)  # a Partial element is reduced first
            sigs.append(PlacementSignature(tuple(ins), (_R,) * len(call.inputs)))
        return list(dict.fromkeys(sigs))

    def comm_axes(self, call: OpCall) -> list[tuple[int, ...]]:
        """Per element, the mesh axes of size > 1 that shard it (``call.placements``: the matched ones)."""
        mesh = call.mesh
        if mesh is None:
            return [() for _ in call.inputs]
        return [
            tuple(a for a, q in enumerate(pl or ()) if mesh.shape[a] > 1 and type(q) is Shard)
            for pl in call.placements
        ]

    def may_run_op_as_is(self, op: Any) -> bool:
        return "kernel" not in vars(self)

    def runs_op_as_is(self, call: OpCall, ctx: LocalContext) -> bool:
        """No element sharded on an axis: the kernel is the op itself on the list (workers replay it)."""
        return "kernel" not in vars(self) and not any(self.comm_axes(call))

    def kernel(self, call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        xs: list[torch.Tensor] = list(args[0] if args else kwargs["self"])
        p, dtype = self.order(call), call.arg("dtype")
        axes = self.comm_axes(call)
        out: list[torch.Tensor | None] = [None] * len(xs)
        local = [i for i, a in enumerate(axes) if not a]
        if local:  # the op itself on the elements no axis shards
            for i, y in zip(local, call.op([xs[i] for i in local], p, dtype=dtype), strict=True):
                out[i] = y
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, a in enumerate(axes):
            if a:
                groups.setdefault(a, []).append(i)
        if groups:
            assert call.mesh is not None
            comm = device_comm(ctx, what=f"{call.op} over sharded tensors")
            for k, (group_axes, members) in enumerate(sorted(groups.items())):
                parts = torch.stack([self._partial(xs[i], p, dtype, call.out_meta[i].dtype) for i in members])
                devices, me = comm_group(call.mesh, ctx.coordinate, group_axes)
                got = exchange(comm, devices, me, [parts] * len(devices), tag=FOREACH_NORM_TAG + k)
                stacked = torch.stack([g.to(parts.device) for g in got])
                total = stacked.amax(0) if p == math.inf else stacked.sum(0)
                if p != math.inf:
                    total = total.sqrt() if p == 2 else total.pow(1.0 / p)
                for j, i in enumerate(members):
                    out[i] = total[j].to(call.out_meta[i].dtype)
        return out

    @staticmethod
    def _partial(x: torch.Tensor, p: float, dtype: Any, out_dtype: torch.dtype) -> torch.Tensor:
        if dtype is not None:
            x = x.to(dtype)
        a = x.abs().to(_acc_dtype(out_dtype))
        if a.numel() == 0:
            return torch.zeros((), dtype=a.dtype, device=a.device)
        if p == math.inf:
            return a.amax()
        return torch.sum(a * a) if p == 2 else torch.sum(a.pow(p))


def _needs_comm(call: OpCall) -> bool:
    rule = get_rule(call.op)
    return isinstance(rule, ForeachNormRule) and any(rule.comm_axes(call))


register_comm_kernel(aten._foreach_norm.Scalar, _needs_comm)
