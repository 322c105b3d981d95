"""Autograd of ``scaled_dot_product_attention`` on dtorch tensors: attention with its log-sum-exp forward, the
fused backward after — so a sequence-sharded attention stays context parallel in both directions.

Composite ops decompose when an input requires grad (``registration._autograd``): for SDPA that is the math path
(``matmul``, ``softmax``, ``matmul``), whose sequence-sharded ``q @ kᵀ`` gathers the keys — no ring, no Ulysses, and
an ``L x S`` score matrix per rank. Instead, :func:`sdpa_autograd` wraps the call in :class:`_Attention`, whose
forward is ``_scaled_dot_product_flash_attention_for_cpu`` (output and log-sum-exp) and whose backward is that op's
backward — both have placement rules with batch/head, query-sequence and context-parallel (Ulysses, ring)
signatures (``placement_rules/families/attention_backward.py``). The name says *cpu* because it is the aten pair
with a device-independent schema (output and log-sum-exp only); what each rank runs is the rule's choice:

- **CPU**, nothing context parallel, the query sequence whole on every rank: the pair itself (torch's fused CPU
  kernel);
- **CUDA**, nothing context parallel (batch/head-sharded, query-sequence-sharded with replicated k/v, or
  replicated): torch's fused CUDA attention — flash (fp16/bf16, no mask) or memory-efficient (a mask, float32) —
  where its local causal mask is the global one (``placement_rules/families/attention_local.py`` decides per rank);
- otherwise (context parallel, a causal query shard below row 0, float64, ...): the rule's blockwise float32
  kernel with global positions (the ring and Ulysses of context parallelism).

Taken when an input requires grad, ``dropout_p == 0``, q/k/v are 4-d with one head size and the mask does not
require grad; GQA (``enable_gqa`` with fewer kv heads) repeats the kv heads first (autograd sums their gradients).
Everything else decomposes as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["sdpa_autograd"]

aten = torch.ops.aten


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, mask = ctx.saved_tensors
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, ctx.causal, attn_mask=mask, scale=ctx.scale
        )
        return dq, dk, dv, None, None, None


def _eligible(q: Any, k: Any, v: Any, mask: Any, dropout_p: float) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or float(dropout_p) != 0.0:
        return False
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        return False
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.requires_grad):
        return False
    return bool(q.requires_grad or k.requires_grad or v.requires_grad)


def sdpa_autograd(default: Callable[..., Any]) -> Callable[..., Any]:
    """The ``AutogradPrivateUse1`` kernel of SDPA: :class:`_Attention` where eligible, ``default`` otherwise (the
    generic composite kernel: decomposes under grad, calls the backend kernel without)."""

    def kernel(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        if torch.is_grad_enabled() and _eligible(query, key, value, attn_mask, dropout_p):
            heads = query.shape[1]
            if enable_gqa and key.shape[1] != heads and heads % key.shape[1] == 0:
                rep = heads // key.shape[1]
                key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
            if query.shape[:2] == key.shape[:2] == value.shape[:2]:
                out: torch.Tensor = _Attention.apply(query, key, value, attn_mask, is_causal, scale)
                return out
        return default(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)

    return kernel
