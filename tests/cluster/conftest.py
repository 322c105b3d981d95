"""Cluster-mode tests: worker processes on this host. Process start-up costs seconds on the 2-core CI machines, so
tests share module-scoped clusters where they can; the ones that must kill a cluster start their own (slow)."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Iterator

import pytest

import torch_dtorch as dt

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by worker processes: tiny kernels, 2 shared cores


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` for every pid to end; the ones still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def leftovers() -> list[str]:
    """Shared-memory files and private socket directories of dtorch still on disk."""
    return glob.glob("/dev/shm/*dtorch*") + [d for d in glob.glob("/tmp/dtorch-*") if os.path.isdir(d)]


@pytest.fixture(autouse=True, scope="module")
def _shutdown_after_module() -> Iterator[None]:
    yield
    dt.shutdown()
