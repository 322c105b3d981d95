"""torch.compile backend tests: real worker threads (a session-wide pool), dynamo reset around every test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import torch_dtorch as dt


@pytest.fixture(autouse=True, scope="session")
def _shutdown_at_end() -> Iterator[None]:
    yield
    dt.shutdown()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
