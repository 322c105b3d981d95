"""Cluster-mode tests: worker processes on this host. Process start-up costs seconds on the 2-core CI machines, so
tests share module-scoped clusters where they can; the ones that must kill a cluster start their own (slow)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

import torch_dtorch as dt
from torch_dtorch.cluster.runner import ClusterRunner

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


def owned_paths(runner: ClusterRunner) -> list[str]:
    """What ``runner`` put on disk: its shared-memory directory and its private socket directories. (Other
    engineers and CI jobs run clusters on the same machine: a global ``/dev/shm/*dtorch*`` scan is not ours.)"""
    paths = [
        runner._tmpdir,
        *(s._tmpdir for s in (runner.net.pub, runner.net.pull) if s is not None and s._tmpdir),
    ]
    if runner.net.shm is not None:
        paths.append(str(runner.net.shm.path))
    assert all(os.path.exists(p) for p in paths), paths
    return paths


def leftovers(paths: list[str]) -> list[str]:
    """The paths of ``paths`` still on disk."""
    return [p for p in paths if os.path.exists(p)]


@pytest.fixture(autouse=True, scope="module")
def _shutdown_after_module() -> Iterator[None]:
    yield
    dt.shutdown()
