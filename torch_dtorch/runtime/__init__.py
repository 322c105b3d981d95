"""Layer 2 — kernel runtime (worker side): ``Blob`` (one operand's local tensor on one device, or a sticky error),
``OpRunner`` (runs one operator on one device) and ``KernelStream`` (a worker thread with its CUDA streams).

Nothing here knows about instructions or the controller; :mod:`torch_dtorch.executor.worker` drives it.
"""

from __future__ import annotations

from torch_dtorch.runtime.blob import Blob, KernelError
from torch_dtorch.runtime.op_runner import KernelIOError, OpRunner, after_hooks, before_hooks
from torch_dtorch.runtime.stream import KernelStream

__all__ = ["Blob", "OpRunner", "KernelError", "KernelIOError", "KernelStream", "after_hooks", "before_hooks"]
