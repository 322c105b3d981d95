"""Training tests run against real worker threads (the eager suite's pool conventions)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import torch_dtorch as dt
from tests.eager.conftest import _shutdown_at_end, init_mesh  # noqa: F401 - the session fixture and helper
from torch_dtorch.device.state import get_session

__all__ = ["init_mesh"]


@pytest.fixture(scope="module")
def process_meshes() -> Iterator[dict[int, dt.DeviceMesh]]:
    """Worker-process meshes of 2 and 4 devices, shared by a module's tests (starting processes takes seconds)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "10")  # a loaded 2-core CI machine can miss the 1 s default
    dt.shutdown()  # a thread pool of an earlier module
    try:
        four = dt.init_device_mesh("cpu", (4,), mode="process")
        assert get_session().mode == "process"
        yield {4: four, 2: dt.init_device_mesh("cpu", (2,), mode="process")}
    finally:
        dt.shutdown()
        mp.undo()
