"""Layer 4 — collectives and transfer between workers.

- :mod:`.group`: the :class:`Group` / :class:`Comm` protocols every backend implements;
- :mod:`.memory`: the in-memory world of thread mode (:class:`InMemoryWorld`, :class:`InMemoryComm`);
- :mod:`.torchdist`: ``torch.distributed`` process groups built from an explicit store (Gloo, NCCL), one per
  rank, so one process can hold several ranks;
- :mod:`.redistribute`: :func:`execute_plan`, one rank's execution of a redistribute plan;
- :mod:`.store`: :class:`TensorStore`, the controller <-> worker channel for tensor bytes.

``execute_plan`` and the ``torchdist`` classes are imported on first access (they pull in the planner and
``torch.distributed``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch_dtorch.collectives.errors import (
    CollectiveAborted,
    CollectiveError,
    CollectiveMismatchError,
    CollectiveTimeout,
    TensorStoreError,
    TensorStoreTimeout,
)
from torch_dtorch.collectives.group import REDUCE_OPS, Comm, Group, Work, collective_timeout_s
from torch_dtorch.collectives.memory import InMemoryComm, InMemoryGroup, InMemoryWorld
from torch_dtorch.collectives.store import MemoryTensorStore, TensorStore

if TYPE_CHECKING:
    from torch_dtorch.collectives.redistribute import execute_plan
    from torch_dtorch.collectives.torchdist import TorchDistComm, TorchDistGroup

__all__ = [
    "REDUCE_OPS",
    "CollectiveAborted",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeout",
    "Comm",
    "Group",
    "InMemoryComm",
    "InMemoryGroup",
    "InMemoryWorld",
    "MemoryTensorStore",
    "TensorStore",
    "TensorStoreError",
    "TensorStoreTimeout",
    "TorchDistComm",
    "TorchDistGroup",
    "Work",
    "collective_timeout_s",
    "execute_plan",
]

_LAZY = {
    "execute_plan": "torch_dtorch.collectives.redistribute",
    "TorchDistComm": "torch_dtorch.collectives.torchdist",
    "TorchDistGroup": "torch_dtorch.collectives.torchdist",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
