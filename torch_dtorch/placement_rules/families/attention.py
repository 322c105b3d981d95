"""Attention family: ``scaled_dot_product_attention`` (CompositeImplicitAutograd: intercepted).

``q [..., L, E]``, ``k [..., S, E]``, ``v [..., S, Ev]``, optional ``attn_mask`` broadcastable to ``[..., L, S]``
-> ``out [..., L, Ev]``. Signatures (one mesh axis):
- **batch / head dims** ``d`` of the output: ``q``, ``k``, ``v`` each ``S`` on the aligned dim where they have it at
  full size (``R`` where it broadcasts), the mask likewise -> ``S(d)``. With ``enable_gqa`` and fewer kv heads the
  head dim (``-3``) is sharded only when every query shard, for every nesting of the mesh axes, holds whole
  groups of ``Hq / Hkv`` heads (then the kv shards are exactly the matching kv heads); otherwise no head signature.
- **query sequence**: ``q S(-2)``, ``k``/``v`` ``R``, mask ``S(-2)`` at full size else ``R`` -> ``S(-2)`` (each
  query row attends to all keys independently). With ``is_causal`` the local kernel replaces the causal flag by an
  explicit mask ``tril(diagonal=offset)`` with this rank's query offset, so the top-left alignment stays global.
- **value features**: ``v S(-1)``, the rest ``R`` -> ``S(-1)``.
- **linearity in v**: ``v P(sum|avg)``, the rest ``R`` -> same ``P``.
- **context parallel** (only on meshes with a CP-named axis: ``cp``, ``ring``, ``ulysses``, ...): ``q``, ``k``,
  ``v`` ``S(-2)``, mask ``R`` -> ``S(-2)``; the kernel runs ring or Ulysses attention over the axes where ``q`` and
  ``k`` are both sequence-sharded (``context_parallel.py``).
- ``dropout_p > 0`` raises ``NotImplementedError`` (the dropout stream of a sharded call cannot equal torch's);
  under autograd the op is decomposed before it reaches this rule anyway.

Cost: ``sdpa_cost`` (``2·B·H·L·S·(E+Ev)``, halved when causal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.graph import Operand, OperatorCost, TensorMeta
from torch_dtorch.ops.cost import sdpa_cost
from torch_dtorch.placement import Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall, every_shard_nonempty
from torch_dtorch.placement_rules.families.context_parallel import (
    cp_axes,
    cp_signatures,
    local_attention_hooks,
    observe_local_attention,
    query_rows_split,
    register_comm_kernel,
    run_context_parallel,
)
from torch_dtorch.placement_rules.families.normalization import groups_split_evenly
from torch_dtorch.placement_rules.growth import bucket, stride_class
from torch_dtorch.placement_rules.rule import Growth, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["sdpa_signatures"]

aten = torch.ops.aten
_R = Replicate()


def _aligned(x: Operand | None, d: int, out_shape: tuple[int, ...]) -> Placement:
    """``S`` on ``x``'s dim aligned with output dim ``d`` if ``x`` has it at full size, else ``R``."""
    if x is None:
        return _R
    a = d - (len(out_shape) - x.ndim)
    return Shard(a) if a >= 0 and x.shape[a] == out_shape[d] else _R


def _qkv(call: OpCall) -> tuple[Operand, Operand, Operand, Operand | None]:
    q, k, v, mask = call.inputs
    assert q is not None and k is not None and v is not None
    return q, k, v, mask


def sdpa_signatures(call: OpCall) -> list[PlacementSignature]:
    q, k, v, mask = _qkv(call)
    out = tuple(call.out_meta[0].shape)
    nd = len(out)
    mesh_shape = call.mesh.shape if call.mesh is not None else ()
    gqa = (
        bool(call.arg("enable_gqa"))
        and nd >= 3
        and q.ndim >= 3
        and k.ndim >= 3
        and k.shape[-3] not in (1, q.shape[-3])
    )
    sigs: list[PlacementSignature] = []
    for d in range(nd - 2):
        if gqa and d == nd - 3:
            if (
                v.ndim < 3
                or v.shape[-3] != k.shape[-3]
                or not groups_split_evenly(q.shape[-3], k.shape[-3], mesh_shape)
            ):
                continue
            head = Shard(q.ndim - 3)
            sigs.append(sig([head, Shard(k.ndim - 3), Shard(v.ndim - 3), _aligned(mask, d, out)], Shard(d)))
            continue
        sigs.append(sig([_aligned(x, d, out) for x in (q, k, v, mask)], Shard(d)))
    # query sequence: rows are independent (the causal offset is handled by the kernel)
    m_seq = Shard(mask.ndim - 2) if mask is not None and mask.ndim >= 2 and mask.shape[-2] == out[-2] else _R
    sigs.append(sig([Shard(q.ndim - 2), _R, _R, m_seq], Shard(nd - 2)))
    sigs += cp_signatures(call)
    # value features
    sigs.append(sig([_R, _R, Shard(v.ndim - 1), _R], Shard(nd - 1)))
    sigs.append(sig([_R] * 4, _R))  # before the Partial ones: a Replicate output wins cost ties
    for reduce_op in ("sum", "avg"):
        sigs.append(sig([_R, _R, Partial(reduce_op), _R], Partial(reduce_op)))
    return sigs


def _check(call: OpCall) -> None:
    if float(call.arg("dropout_p") or 0.0) > 0.0:
        raise NotImplementedError(
            f"{call.op}: dropout_p={call.arg('dropout_p')} is not supported on dtorch tensors (the dropout mask of a "
            "sharded call cannot equal torch's); use dropout_p=0.0 (eval) or apply dropout to the output separately"
        )


def _kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A query shard of a causal call gets the explicit mask ``tril(diagonal=offset)`` instead of ``is_causal``;
    an empty output shard is made directly."""
    names = [a.name for a in call.op._schema.arguments]
    bound = dict(zip(names, args)) | kwargs
    if cp_axes(call):
        return run_context_parallel(call, ctx, bound)
    if local_attention_hooks:
        observe_local_attention(ctx.device, bound["query"], bound["key"], bound["value"])
    if math.prod(ctx.out_shapes[0]) == 0:  # an empty shard: torch's math path broadcasts 1 against 0 to 1
        return bound["query"].new_empty(ctx.out_shapes[0], dtype=call.out_meta[0].dtype)
    l_global = call.out_meta[0].shape[-2]
    l_local, offset = ctx.out_shapes[0][-2], ctx.out_offsets[0][-2]
    if not bound.get("is_causal", False) or (l_local == l_global and offset == 0):
        return call.op(*args, **kwargs)
    q, k = bound["query"], bound["key"]
    mask = torch.ones(l_local, k.shape[-2], dtype=torch.bool, device=q.device).tril(diagonal=offset)
    bound.update(attn_mask=mask, is_causal=False)
    return call.op(**bound)


def _as_is(call: OpCall) -> bool:
    """:func:`_kernel` is the op itself on every rank's shards, so workers resolve it once and replay it (the
    native loop on CUDA): nothing context parallel, no observer hook (tests), no empty shard, and a causal call's
    query sequence whole on every rank (a query shard needs its own offset mask)."""
    mesh = call.mesh
    if mesh is None or cp_axes(call) or local_attention_hooks:
        return False
    if call.arg("is_causal"):
        q, pq = call.inputs[0], call.placements[0]
        if q is None or pq is None or query_rows_split(mesh, q, pq):
            return False
    return every_shard_nonempty(call)


def _cost(call: OpCall) -> OperatorCost:
    q, k, v, _ = _qkv(call)
    out = call.out_meta[0].shape
    return sdpa_cost(
        call.inputs,
        call.out_meta,
        batch_heads=math.prod(out[:-2]),
        q_len=q.shape[-2],
        kv_len=k.shape[-2],
        head_dim=q.shape[-1],
        v_dim=v.shape[-1],
        causal=bool(call.arg("is_causal")),
    )


def _growth_key(call: OpCall) -> Any:
    """The key length ``S`` (``k``/``v`` dim -2, the mask's last dim) bucketed, everything else exact: the
    signatures look at batch and head dims and the query length, the matcher's empty-shard test at ``S`` (context
    parallel signature); the output ``[..., L, Ev]`` does not depend on ``S`` (``growth.py``). ``None`` unless
    ``k`` and ``v`` have one ``S`` and the mask's last dim is 1 or ``S`` (other calls: torch's errors)."""
    q, k, v, mask = _qkv(call)
    mesh = call.mesh
    if mesh is None or min(q.ndim, k.ndim, v.ndim) < 2 or q.stride is None:
        return None
    s = k.shape[-2]
    if v.shape[-2] != s:
        return None

    def grown(x: Operand, d: int) -> tuple[Any, ...]:
        shape = list(x.shape)
        shape[d] = bucket(shape[d], mesh)
        return (tuple(shape), stride_class(x.shape, x.stride))

    mkey: Any = None
    if mask is not None:
        if mask.ndim == 0 or mask.shape[-1] not in (1, s):
            return None
        mkey = (mask.shape[-1] == 1 and s != 1, *grown(mask, mask.ndim - 1))
    return (q.shape, q.stride, grown(k, k.ndim - 2), grown(v, v.ndim - 2), mkey)


def _grown_meta(call: OpCall, kept: Sequence[TensorMeta]) -> list[TensorMeta] | None:
    """The kept output (its shape is ``q``'s and ``v``'s, which the key holds)."""
    return list(kept)


@register_rule(
    aten.scaled_dot_product_attention.default,
    family="attention",
    intercept=True,
    check=_check,
    kernel=_kernel,
    as_is=_as_is,
    cost=_cost,
    growth=Growth(_growth_key, _grown_meta),
)
def scaled_dot_product_attention(call: OpCall) -> list[PlacementSignature]:
    """Batch/head dims (GQA when heads split in whole groups), query sequence, value features, linear in v."""
    return sdpa_signatures(call)


register_comm_kernel(aten.scaled_dot_product_attention.default, lambda call: bool(cp_axes(call)))
