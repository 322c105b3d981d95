"""``attention_local.choose_kernel``: which local kernel the attention pair runs (torch's fused CUDA flash /
memory-efficient attention, or the blockwise float32 kernel), over devices, dtypes, masks, causal alignment, CP and
head sizes. Only shapes and dtypes are read, so meta tensors stand in; ``support`` plays the device."""

from __future__ import annotations

import pytest
import torch

from torch_dtorch.placement_rules.families.attention_local import (
    Choice,
    CudaSupport,
    Kernel,
    choose_kernel,
    cuda_support,
)

H100 = CudaSupport((9, 0))
V100 = CudaSupport((7, 0))
BF16 = torch.bfloat16


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _choose(
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = True,
    dropout_p: float = 0.0,
    context_parallel: bool = False,
    query_offset: int = 0,
    support: CudaSupport | None = H100,
) -> Choice:
    q = _t(2, 4, 16, 64) if q is None else q
    k = _t(*q.shape[:2], 16, q.shape[-1], dtype=q.dtype) if k is None else k
    v = _t(*k.shape, dtype=k.dtype) if v is None else v
    return choose_kernel(
        q, k, v, mask, causal=causal, dropout_p=dropout_p, context_parallel=context_parallel,
        query_offset=query_offset, support=support,
    )  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_without_mask_is_flash(causal: bool, dtype: torch.dtype) -> None:
    c = _choose(_t(2, 4, 16, 64, dtype=dtype), causal=causal)
    assert c.kernel is Kernel.FLASH and c.fused, c


def test_cpu_and_context_parallel_and_dropout_stay_blockwise() -> None:
    assert _choose(support=None).kernel is Kernel.BLOCKWISE  # the CPU (its own fused op is ``fused_locally``)
    c = _choose(context_parallel=True)
    assert c.kernel is Kernel.BLOCKWISE and "context parallel" in c.reason and not c.fused
    assert _choose(dropout_p=0.1).kernel is Kernel.BLOCKWISE


def test_float32_is_memory_efficient_and_float64_blockwise() -> None:
    assert _choose(_t(2, 4, 16, 64, dtype=torch.float32)).kernel is Kernel.EFFICIENT
    assert _choose(_t(2, 4, 16, 64, dtype=torch.float64)).kernel is Kernel.BLOCKWISE


@pytest.mark.parametrize(
    "mask",
    [
        _t(16, 16, dtype=torch.bool),
        _t(2, 1, 16, 16, dtype=BF16),
        _t(1, 16, dtype=torch.bool),  # one row broadcast over the queries
        _t(16, 1, dtype=torch.float32),  # one column broadcast over the keys
    ],
    ids=["bool-LS", "float-B1LS", "bool-1S", "float-L1"],
)
def test_a_mask_takes_the_memory_efficient_kernel(mask: torch.Tensor) -> None:
    assert _choose(mask=mask).kernel is Kernel.EFFICIENT


def test_masks_the_fused_kernels_cannot_take_stay_blockwise() -> None:
    assert _choose(mask=_t(16, 16, dtype=torch.int64)).kernel is Kernel.BLOCKWISE
    # a mask of the global query rows on a query shard of 8 rows: not the local scores
    assert (
        _choose(_t(2, 4, 8, 64), mask=_t(16, 16, dtype=torch.bool), causal=False).kernel is Kernel.BLOCKWISE
    )


def test_causal_alignment() -> None:
    """Causal takes a fused kernel only where the local top-left mask is the global one: queries from row 0."""
    q_shard = _t(2, 4, 8, 64)  # a query-sequence shard (k/v replicated: 16 keys)
    assert _choose(q_shard, causal=False, query_offset=8).kernel is Kernel.FLASH  # rows are independent
    assert _choose(q_shard, causal=True, query_offset=8).kernel is Kernel.BLOCKWISE
    # rows 0..7 of 16 keys: aligned, but not square, which torch's flash does not take causally
    assert _choose(q_shard, causal=True, query_offset=0).kernel is Kernel.EFFICIENT
    assert _choose(q_shard, causal=False, query_offset=0).kernel is Kernel.FLASH


def test_shapes_and_head_sizes() -> None:
    assert _choose(_t(2, 4, 16, 256)).kernel is Kernel.FLASH
    assert _choose(_t(2, 4, 16, 512)).kernel is Kernel.BLOCKWISE
    assert _choose(_t(2, 4, 16, 60)).kernel is Kernel.BLOCKWISE  # not a multiple of 8
    assert _choose(v=_t(2, 4, 16, 32)).kernel is Kernel.BLOCKWISE  # a value head size of its own
    assert _choose(_t(4, 16, 64), _t(4, 16, 64), _t(4, 16, 64)).kernel is Kernel.BLOCKWISE  # 3-d
    assert _choose(_t(0, 4, 16, 64)).kernel is Kernel.BLOCKWISE  # an empty shard
    assert _choose(k=_t(2, 4, 16, 64, dtype=torch.float16)).kernel is Kernel.BLOCKWISE  # mixed dtypes


def test_device_support() -> None:
    """bf16/fp16 flash needs sm80; flash or memory-efficient disabled (or not built) falls through."""
    assert _choose(support=V100).kernel is Kernel.EFFICIENT
    assert _choose(support=CudaSupport((9, 0), flash=False)).kernel is Kernel.EFFICIENT
    assert _choose(support=CudaSupport((9, 0), flash=False, efficient=False)).kernel is Kernel.BLOCKWISE
    assert _choose(
        mask=_t(16, 16, dtype=torch.bool), support=CudaSupport((9, 0), efficient=False)
    ).kernel is (Kernel.BLOCKWISE)


def test_cuda_support_is_none_off_cuda() -> None:
    assert cuda_support(torch.device("cpu")) is None
    assert cuda_support(torch.device("meta")) is None
