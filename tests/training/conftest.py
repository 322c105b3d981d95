"""Training tests run against real worker threads (the eager suite's pool conventions)."""

from __future__ import annotations

from tests.eager.conftest import _shutdown_at_end, init_mesh  # noqa: F401 - the session fixture and helper

__all__ = ["init_mesh"]
