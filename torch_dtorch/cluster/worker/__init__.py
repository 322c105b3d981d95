"""The worker side of process mode: :class:`WorkerProcess` (one device, one process) and its command line
(``python -m torch_dtorch.cluster.worker``, ``dtorch worker``)."""

from __future__ import annotations

from torch_dtorch.cluster.worker.cli import main, run_and_exit, serve
from torch_dtorch.cluster.worker.process import WorkerProcess

__all__ = ["WorkerProcess", "main", "run_and_exit", "serve"]
