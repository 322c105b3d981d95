"""``DeviceMemoryError``: a ``torch.OutOfMemoryError`` (so importing it imports torch; ``torch_dtorch.errors``
re-exports it lazily and stays importable without torch)."""

from __future__ import annotations

import torch

from torch_dtorch.errors import DTorchError

__all__ = ["DeviceMemoryError"]


class DeviceMemoryError(DTorchError, torch.OutOfMemoryError):
    """An allocation a rule planned (factory, upload, op output, redistribute buffer) does not fit in its devices'
    free memory: raised on the controller before anything is sent (``torch.OutOfMemoryError``, so code that
    catches that catches this). ``op``, ``need_bytes``, ``free_bytes`` and ``pool`` say what, how much and where."""

    def __init__(
        self, message: str, *, op: str = "", need_bytes: int = 0, free_bytes: int = 0, pool: str = ""
    ) -> None:
        super().__init__(message)
        self.op = op
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes
        self.pool = pool
