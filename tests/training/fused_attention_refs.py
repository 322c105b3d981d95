"""CPU stand-ins for torch's fused CUDA attention ops, with their schemas and output conventions, for exercising
``attention_local``'s glue without a GPU (``tests/training/test_attention_fused.py``).

Each is ``_scaled_dot_product_flash_attention_for_cpu`` (or its backward) underneath, and checks what the real
kernels require or what only a correct caller passes: dropout 0, a contiguous last dim, the flash backward's
``cum_seq`` ``None`` / ``max_q`` / ``max_k`` / philox placeholders of the forward's kind, ``lse [B, H, L]``
float32, the memory-efficient bias in q's dtype expanded to ``[B, H, L, S]`` with an aligned row stride. Their
outputs look like the CUDA ones: flash's ``out`` in its ``[B, L, H, E]`` memory layout, the memory-efficient
``logsumexp`` padded to 32 rows with NaN (a caller that does not slice it poisons the backward)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.families import attention_backward as ab
from torch_dtorch.placement_rules.families import attention_local as al

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _dense(*xs: torch.Tensor) -> None:
    for x in xs:
        assert x.stride(-1) == 1, "the fused kernels need a contiguous last dim"


class FusedRefs:
    """The four ops, counting their calls (``calls``) and recording the ``causal`` flags they got."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.causal: list[bool] = []

    def flash_forward(
        self,
        q: Any,
        k: Any,
        v: Any,
        dropout_p: float,
        is_causal: bool,
        return_debug_mask: bool,
        *,
        scale: Any,
    ) -> tuple[Any, ...]:
        assert dropout_p == 0.0 and return_debug_mask is False
        assert q.dtype in al.FLASH_DTYPES and q.dtype == k.dtype == v.dtype
        assert not is_causal or q.shape[-2] == k.shape[-2], "torch's flash takes no causal non-square call"
        _dense(q, k, v)
        self.calls["flash_forward"] += 1
        self.causal.append(is_causal)
        out, lse = _FWD(q, k, v, 0.0, is_causal, scale=scale)
        out = out.transpose(1, 2).contiguous().transpose(1, 2)  # flash's [B, L, H, E] memory layout
        seed = torch.full((2,), 7, dtype=torch.uint64)
        return (
            out,
            lse,
            None,
            None,
            q.shape[-2],
            k.shape[-2],
            seed,
            torch.zeros((), dtype=torch.uint64),
            q[:0],
        )

    def flash_backward(
        self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, cum_q: Any, cum_k: Any, max_q: int,
        max_k: int, dropout_p: float, is_causal: bool, seed: Any, offset: Any, *, scale: Any,
    ) -> tuple[Any, ...]:  # fmt: skip
        assert cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[-2], k.shape[-2])
        assert dropout_p == 0.0
        assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1] and lse.is_contiguous()
        (seed_shape, seed_dtype), (off_shape, off_dtype) = al._philox_like(al.Kernel.FLASH)
        assert (tuple(seed.shape), seed.dtype, tuple(offset.shape), offset.dtype) == (
            seed_shape, seed_dtype, off_shape, off_dtype,
        )  # fmt: skip
        _dense(dout, q, k, v, out)
        self.calls["flash_backward"] += 1
        self.causal.append(is_causal)
        return tuple(_BWD(dout, q, k, v, out, lse, 0.0, is_causal, scale=scale))

    def efficient_forward(
        self, q: Any, k: Any, v: Any, bias: Any, compute_log_sumexp: bool, dropout_p: float, is_causal: bool,
        *, scale: Any,
    ) -> tuple[Any, ...]:  # fmt: skip
        assert compute_log_sumexp and dropout_p == 0.0
        self._check_bias(bias, q, k)
        _dense(q, k, v)
        self.calls["efficient_forward"] += 1
        self.causal.append(is_causal)
        out, lse = _FWD(q, k, v, 0.0, is_causal, attn_mask=bias, scale=scale)
        pad = -lse.shape[-1] % al.LSE_ROWS_MULTIPLE + al.LSE_ROWS_MULTIPLE  # always some padding
        lse = torch.nn.functional.pad(lse, (0, pad), value=float("nan"))
        return out, lse, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)

    def efficient_backward(
        self, dout: Any, q: Any, k: Any, v: Any, bias: Any, out: Any, lse: Any, seed: Any, offset: Any,
        dropout_p: float, grad_input_mask: Any, is_causal: bool, *, scale: Any,
    ) -> tuple[Any, ...]:  # fmt: skip
        L = q.shape[-2]
        assert dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
        assert lse.dtype == torch.float32 and lse.shape[:-1] == q.shape[:-2]
        assert lse.shape[-1] >= L and lse.shape[-1] % al.LSE_ROWS_MULTIPLE == 0, lse.shape
        assert bool(torch.isfinite(lse).all()), "the forward's NaN padding came back: its lse was not sliced"
        assert seed.dtype == offset.dtype == torch.int64
        self._check_bias(bias, q, k)
        _dense(dout, q, k, v, out)
        self.calls["efficient_backward"] += 1
        self.causal.append(is_causal)
        dq, dk, dv = _BWD(dout, q, k, v, out, lse[..., :L], 0.0, is_causal, attn_mask=bias, scale=scale)
        return dq, dk, dv, None

    @staticmethod
    def _check_bias(bias: Any, q: Any, k: Any) -> None:
        if bias is None:
            return
        assert bias.dtype == q.dtype, "the bias is additive, in q's dtype"
        assert tuple(bias.shape) == (*q.shape[:-1], k.shape[-2])
        assert bias.stride(-1) == 1 and all(s % al.BIAS_ALIGNMENT == 0 for s in bias.stride()[:-1])


def emulate_cuda(monkeypatch: pytest.MonkeyPatch) -> FusedRefs:
    """Make the attention pair's kernels on CPU workers take the fused CUDA path, with :class:`FusedRefs` as the
    ops: an H100's support, the CPU shortcut (``fused_locally``: torch's CPU op as is) off in the kernels and in the
    workers' replay (a rule with a patched ``kernel`` takes the general path). Thread mode only."""
    refs = FusedRefs()
    monkeypatch.setattr(ab, "cuda_support", lambda device: al.CudaSupport((9, 0)))
    monkeypatch.setattr(ab, "fused_locally", lambda call: False)
    for op in (ab.ATTENTION_WITH_LSE, ab.ATTENTION_BACKWARD):
        rule = get_rule(op)
        monkeypatch.setattr(rule, "kernel", rule.kernel)
    monkeypatch.setattr(al, "FLASH_FORWARD", refs.flash_forward)
    monkeypatch.setattr(al, "FLASH_BACKWARD", refs.flash_backward)
    monkeypatch.setattr(al, "EFFICIENT_FORWARD", refs.efficient_forward)
    monkeypatch.setattr(al, "EFFICIENT_BACKWARD", refs.efficient_backward)
    return refs
