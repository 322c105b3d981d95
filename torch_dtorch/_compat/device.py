"""The ``dtorch`` device's private torch hooks: PrivateUse1 registration, dispatch keys and the dispatch-mode stack,
storage-less tensors, the CUDA caching allocator's statistics, and tensor introspection that works on fake tensors.

Wraps ``torch.utils.backend_registration._setup_privateuseone_for_python_backend``,
``torch._C._dispatch_has_kernel_for_dispatch_key``, ``torch._C._len_torch_dispatch_stack``,
``torch._C._acc.create_empty_tensor``, ``torch._C._cuda_memoryStats``, ``torch._C._is_alias_of`` and
``torch._subclasses.fake_tensor.FakeTensor``: no public API registers a Python-only backend, asks the dispatcher
for a kernel, makes a tensor without storage, reads the allocator's statistics without flattening them all, or
compares storages of fake/functional tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch._compat.autograd import explain_cuda_autograd_conflict


def has_kernel_for_dispatch_key(op: Any, key: str) -> bool:
    """Whether ``op`` (an OpOverload) has a kernel registered for dispatch key ``key``."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key))


def cuda_cached_free_bytes(device: int) -> int:
    """Bytes PyTorch's CUDA caching allocator holds reserved but unallocated on ``device``. Read from the nested
    statistics dict: ``torch.cuda.memory_reserved`` flattens every statistic in Python first (~150 us a call, and
    the memory check reads it on the eager hot path)."""
    if not torch.cuda.is_initialized():
        return 0
    stats = torch._C._cuda_memoryStats(device)
    try:
        return max(
            0,
            int(stats["reserved_bytes"]["all"]["current"]) - int(stats["allocated_bytes"]["all"]["current"]),
        )
    except KeyError:  # a torch that reshaped its statistics: the public (slower) figures
        return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def create_empty_tensor(size: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A storage-less tensor on the PrivateUse1 device (costs ~100 bytes whatever its shape)."""
    return torch._C._acc.create_empty_tensor(tuple(size), dtype)


#: ``() -> int``: how many ``TorchDispatchMode``s are active (fake tensors, functionalization and proxy tracing of
#: torch.compile are modes): a kernel that skips the rest of the dispatcher must not do so while one is
dispatch_mode_depth = torch._C._len_torch_dispatch_stack


def setup_privateuse1_python_backend(name: str) -> None:
    """Rename PrivateUse1 and register the dummy hooks/guard a Python backend needs."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(name)
    explain_cuda_autograd_conflict()


def is_alias_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a storage. Works on fake and functional tensors (inductor's tracing of a worker's
    segment), where ``untyped_storage().data_ptr()`` raises "invalid python storage"."""
    return bool(torch._C._is_alias_of(a, b))  # type: ignore[attr-defined]


def is_fake_tensor(t: object) -> bool:
    """Whether ``t`` is a FakeTensor (what dynamo hands a backend as example inputs)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
