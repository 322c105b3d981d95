"""Eager tests run against real workers; the pool is shared by the whole session and reset at the end.

``DTORCH_TEST_MODE=process`` runs the suite with one worker process per device (cluster mode) instead of threads;
tests that reach into worker threads (hooks, monkeypatched kernels, worker objects) are marked ``thread_only``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import pytest

import torch_dtorch as dt

#: ``DTORCH_TEST_DEVICE=cuda`` runs the eager suite with every mesh simulated on one GPU (the device-tool run)
TEST_DEVICE = os.environ.get("DTORCH_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cuda":  # reference tensors and inputs live on the GPU too, so comparisons need no moves
    import torch

    torch.set_default_device("cuda")


#: ``DTORCH_TEST_MODE=process`` runs every mesh of the eager suite on worker processes (cluster mode)
TEST_MODE = os.environ.get("DTORCH_TEST_MODE", "thread")
if TEST_MODE not in ("thread", "process"):
    raise ValueError(f"DTORCH_TEST_MODE={TEST_MODE!r} must be 'thread' or 'process'")

#: tests that reach into worker threads of this process (kernel hooks, monkeypatched rules, ``runner.workers``)
thread_only = pytest.mark.skipif(
    TEST_MODE != "thread",
    reason="reaches into worker threads; workers are separate processes in process mode",
)


def init_mesh(shape: Sequence[int] | int, **kwargs: object) -> dt.DeviceMesh:
    if TEST_DEVICE == "cuda":
        return dt.init_device_mesh("cuda", shape, simulate=True, mode=TEST_MODE, **kwargs)  # type: ignore[arg-type]
    return dt.init_device_mesh("cpu", shape, mode=TEST_MODE, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(autouse=True, scope="session")
def _shutdown_at_end() -> Iterator[None]:
    yield
    dt.shutdown()


MESH_SHAPES = [(1,), (2,), (3,), (4,), (2, 2)]


def mesh_ids(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))
