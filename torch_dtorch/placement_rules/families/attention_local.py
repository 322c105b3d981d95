"""The local kernel of the attention pair (``attention_backward.py``) on CUDA when nothing is context parallel:
torch's own fused attention (flash or memory-efficient) instead of the blockwise float32 computation.

:func:`choose_kernel` is the one decision; :func:`fused_forward` / :func:`fused_backward` map the pair's arguments
onto torch's fused CUDA ops and their results back:

- ``_scaled_dot_product_flash_attention`` -> ``out``, ``logsumexp [B, H, L]`` float32 (natural log of the summed
  exponentials of the scaled scores: what the blockwise kernel and the query-sequence signature, ``lse S(-1)``,
  expect), and its backward, called with ``cum_seq`` ``None``, ``max_q = L``, ``max_k = S``, ``dropout_p = 0`` and
  placeholder philox tensors (the pair's forward returns only ``out`` and ``lse``; without dropout the kernels never
  read them);
- ``_scaled_dot_product_efficient_attention`` (a mask, or float32): the mask becomes the additive ``attn_bias`` in
  the query's dtype (a boolean mask ``-inf`` where false, as torch's SDPA does), aligned as the kernel requires, and
  expanded to ``[B, H, L, S]``; its ``logsumexp`` is padded to a multiple of 32 rows on CUDA builds: sliced to
  ``[..., L]`` after the forward, padded again for the backward.

Kept dense: q/k/v last dims made contiguous where they are not (the kernels require it), ``lse`` float32 and
contiguous for the backward.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from enum import Enum

import torch

__all__ = [
    "Choice",
    "CudaSupport",
    "Kernel",
    "choose_kernel",
    "cuda_support",
    "fused_backward",
    "fused_forward",
]

log = logging.getLogger(__name__)

aten = torch.ops.aten
#: torch's fused CUDA attention ops (module attributes, looked up per call: tests swap in CPU references)
FLASH_FORWARD = aten._scaled_dot_product_flash_attention.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT_FORWARD = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default

FLASH_DTYPES = (torch.float16, torch.bfloat16)
EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the largest head size either fused kernel takes here (flash's limit), and the multiple it must be
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
#: the memory-efficient forward pads ``logsumexp``'s last dim to a multiple of this on CUDA builds
LSE_ROWS_MULTIPLE = 32
#: the memory-efficient kernels want the bias's row stride a multiple of this (torch pads the bias as well)
BIAS_ALIGNMENT = 16


class Kernel(Enum):
    FLASH = "flash"
    EFFICIENT = "efficient"
    BLOCKWISE = "blockwise"


@dataclass(frozen=True)
class Choice:
    """The local kernel of one call on one rank, and why (``reason``: logged at DEBUG, read by tests)."""

    kernel: Kernel
    reason: str

    @property
    def fused(self) -> bool:
        return self.kernel is not Kernel.BLOCKWISE


@dataclass(frozen=True)
class CudaSupport:
    """What the device offers: its compute capability and which of torch's fused kernels are built and enabled
    (``torch.backends.cuda.enable_flash_sdp(False)`` / ``enable_mem_efficient_sdp(False)`` turn them off here too)."""

    capability: tuple[int, int]
    flash: bool = True
    efficient: bool = True


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return int(major), int(minor)


def cuda_support(device: torch.device) -> CudaSupport | None:
    """:class:`CudaSupport` of ``device``; ``None`` off CUDA (the blockwise kernel runs)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return CudaSupport(
        _capability(index),
        flash=torch.backends.cuda.is_flash_attention_available() and torch.backends.cuda.flash_sdp_enabled(),
        efficient=torch.backends.cuda.mem_efficient_sdp_enabled(),
    )


def choose_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    dropout_p: float,
    context_parallel: bool,
    query_offset: int,
    support: CudaSupport | None,
) -> Choice:
    """Which kernel computes one rank's attention (forward and backward decide alike, on the same local shapes).

    ``q`` / ``k`` / ``v`` / ``mask`` are the rank's local tensors (only shapes and dtypes are read);
    ``context_parallel``: a CP axis is involved (ring or Ulysses: the blockwise kernel with global positions
    communicates); ``query_offset``: the global row of the rank's first query (sequence-sharded queries);
    ``support``: :func:`cuda_support` of the device.

    Fused (torch's CUDA kernels, as torch's own SDPA would run them) only when the local computation *is* plain
    attention on local tensors:

    - on CUDA (``support``), nothing context parallel (the keys are then whole on the rank: batch/head-sharded,
      query-sequence-sharded with replicated k/v, or replicated), no dropout, no empty shard;
    - 4-d q/k/v with one (batch, head) shape and one head size, a multiple of 8 and at most 256, one dtype;
    - causal only where the fused kernels' local causal mask (top-left, on local rows) is the global one: the
      rank's queries start at row 0 (a query shard further down needs the global offset: blockwise);
    - **flash**: fp16/bf16, no mask, compute capability >= 8.0, and ``L == S`` when causal (torch's flash does not
      take a causal non-square call);
    - **memory-efficient** otherwise: fp16/bf16/fp32 (a mask broadcastable to ``[B, H, L, S]``, boolean or
      floating, becomes its additive bias).

    Everything else (CPU, CP, dropout, float64, a mask the kernels cannot take) keeps the blockwise kernel."""

    def blockwise(why: str) -> Choice:
        return Choice(Kernel.BLOCKWISE, why)

    if support is None:
        return blockwise("not on CUDA")
    if context_parallel:
        return blockwise("context parallel: ring / Ulysses attention with global positions")
    if float(dropout_p) != 0.0:
        return blockwise("dropout")
    if not (q.ndim == k.ndim == v.ndim == 4) or not (q.shape[:2] == k.shape[:2] == v.shape[:2]):
        return blockwise("not 4-d q/k/v of one (batch, head) shape")
    e = q.shape[-1]
    if not (k.shape[-1] == v.shape[-1] == e) or e % HEAD_DIM_MULTIPLE or e > MAX_HEAD_DIM:
        return blockwise(f"head sizes q {e}, k {k.shape[-1]}, v {v.shape[-1]}")
    if not (q.dtype == k.dtype == v.dtype):
        return blockwise("q, k, v of different dtypes")
    if q.numel() == 0 or k.numel() == 0:
        return blockwise("an empty shard")
    if causal and query_offset != 0:
        return blockwise("causal on a query shard below row 0: the fused causal mask is local")
    L, S = q.shape[-2], k.shape[-2]
    if mask is not None:
        if mask.dtype != torch.bool and not mask.is_floating_point():
            return blockwise(f"a {mask.dtype} mask")
        try:
            torch.broadcast_shapes(tuple(mask.shape), (q.shape[0], q.shape[1], L, S))
        except RuntimeError:
            return blockwise(f"a mask {list(mask.shape)} that does not broadcast to the local scores")
    elif (
        support.flash and q.dtype in FLASH_DTYPES and support.capability >= (8, 0) and (not causal or L == S)
    ):
        return Choice(Kernel.FLASH, "fp16/bf16 without a mask")
    if support.efficient and q.dtype in EFFICIENT_DTYPES:
        return Choice(
            Kernel.EFFICIENT, "a mask" if mask is not None else f"{q.dtype}, causal {causal}, L {L}, S {S}"
        )
    return blockwise(f"{q.dtype} without an enabled fused kernel")


def _dense(x: torch.Tensor) -> torch.Tensor:
    """The fused kernels require a contiguous last dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The memory-efficient kernels' ``attn_bias``: additive, q's dtype, 4-d, row stride aligned, expanded."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    else:
        bias = mask.to(q.dtype)
    while bias.ndim < 4:
        bias = bias.unsqueeze(0)
    s = k.shape[-2]
    bias = bias.expand(*bias.shape[:-1], s)  # a key dim of 1 broadcast: materialized below (stride 0)
    if bias.stride(-1) != 1 or any(st % BIAS_ALIGNMENT for st in bias.stride()[:-1]):
        padded = bias.new_zeros(*bias.shape[:-1], s + -s % BIAS_ALIGNMENT)
        padded[..., :s].copy_(bias)
        bias = padded[..., :s]
    return bias.expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])


@functools.cache
def _philox_like(kernel: Kernel) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """Shapes and dtypes of the philox outputs of ``kernel``'s forward in this torch (flash: ``uint64 [2]`` / ``[]``
    since its rng_state change, ``int64 []`` before; memory-efficient: ``int64 []``), from its meta kernel: the
    backward gets zero placeholders of the same kind (without dropout it never reads them)."""
    q = torch.empty(1, 1, 1, HEAD_DIM_MULTIPLE, dtype=torch.float16, device="meta")
    if kernel is Kernel.FLASH:
        outs = aten._scaled_dot_product_flash_attention.default(q, q, q, 0.0, False, False)
        seed, offset = outs[6], outs[7]
    else:
        _, _, seed, offset = aten._scaled_dot_product_efficient_attention.default(q, q, q, None, True)
    return (tuple(seed.shape), seed.dtype), (tuple(offset.shape), offset.dtype)


def _philox(kernel: Kernel, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    seed, offset = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in _philox_like(kernel))
    return seed, offset


def fused_forward(
    choice: Choice,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H, L, Ev], lse [B, H, L] float32)`` by the fused kernel ``choice`` names."""
    q, k, v = _dense(q), _dense(k), _dense(v)
    if choice.kernel is Kernel.FLASH:
        outs = FLASH_FORWARD(q, k, v, 0.0, causal, False, scale=scale)
        return outs[0], outs[1]
    assert choice.kernel is Kernel.EFFICIENT, choice
    out, lse, _, _ = EFFICIENT_FORWARD(q, k, v, _bias(mask, q, k), True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]].contiguous()


def fused_backward(
    choice: Choice,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    causal: bool,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` by the fused backward of ``choice``, from the forward's ``out`` and ``lse [B, H, L]``."""
    dout, q, k, v, out = (_dense(x) for x in (dout, q, k, v, out))
    lse = lse.float().contiguous()
    seed, offset = _philox(choice.kernel, q.device)
    L, S = q.shape[-2], k.shape[-2]
    if choice.kernel is Kernel.FLASH:
        dq, dk, dv = FLASH_BACKWARD(
            dout, q, k, v, out, lse, None, None, L, S, 0.0, causal, seed, offset, scale=scale
        )
        return dq, dk, dv
    assert choice.kernel is Kernel.EFFICIENT, choice
    lse = torch.nn.functional.pad(
        lse, (0, -L % LSE_ROWS_MULTIPLE)
    )  # as the forward left it (never read past L)
    dq, dk, dv, _ = EFFICIENT_BACKWARD(
        dout, q, k, v, _bias(mask, q, k), out, lse, seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )  # fmt: skip
    return dq, dk, dv
