"""``Runner``: what the eager executor needs of the workers' side, whichever mode runs them.

:class:`~torch_dtorch.executor.thread_runner.ThreadRunner` (one worker thread per device in this process) and
:class:`~torch_dtorch.cluster.runner.ClusterRunner` (one worker process per device, local or remote) both satisfy it;
the :class:`~torch_dtorch.executor.eager.EagerGraphExecutor` and the device layer's session use nothing else (a
runner may add optional parts that callers look up with ``getattr``: ``memory_pools()`` for the memory pre-check,
``failed`` for a lost worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch_dtorch.collectives.store import TensorStore
from torch_dtorch.executor.instructions import Instruction

__all__ = ["Runner"]


@runtime_checkable
class Runner(Protocol):
    """The workers of one pool, seen from the controller."""

    @property
    def devices(self) -> tuple[int, ...]:
        """Device ids (worker ranks), one worker each."""
        ...

    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        ...

    @property
    def store(self) -> TensorStore:
        """Where uploads go (``put((key, device), tensor)``) and values come back (``pop((key, device))``)."""
        ...

    def submit(self, batch: Sequence[Instruction]) -> None:
        """Send ``batch`` to every worker, in order after everything submitted before."""
        ...

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Whether every worker ran everything submitted so far, waiting up to ``timeout`` seconds."""
        ...

    def shutdown(self, *, timeout: float = 10.0) -> None:
        """Stop the workers (idempotent)."""
        ...

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called."""
        ...
