"""Llama app tests: a tiny random LlamaForCausalLM built offline, laid out on real worker pools (threads or
processes) and compared with single-device transformers on the same weights and inputs."""

from __future__ import annotations

from tests.eager.conftest import _shutdown_at_end  # noqa: F401 - the session fixture that shuts the pool down
