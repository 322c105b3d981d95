"""Debugging-tool tests share the eager suite's worker pool conventions (thread mode: they use kernel hooks)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.eager.conftest import _shutdown_at_end, init_mesh  # noqa: F401 - the session fixture and helper
from torch_dtorch.runtime import op_runner as kernel_module

__all__ = ["init_mesh"]


@pytest.fixture(autouse=True)
def _clean_hooks() -> Iterator[None]:
    yield
    kernel_module.before_hooks.clear()
    kernel_module.after_hooks.clear()
