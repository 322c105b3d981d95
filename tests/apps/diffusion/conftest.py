"""Diffusion app tests: tiny random pipelines built offline, run on real worker pools (threads or processes)."""

from __future__ import annotations

from tests.eager.conftest import _shutdown_at_end  # noqa: F401 - the session fixture that shuts the pool down
