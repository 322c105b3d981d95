"""``python -m torch_dtorch.cluster.worker --help``: one cluster-mode worker process."""

from __future__ import annotations

from torch_dtorch.cluster.worker.cli import run_and_exit

if __name__ == "__main__":
    run_and_exit()
