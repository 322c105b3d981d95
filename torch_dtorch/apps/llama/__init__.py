"""Llama on a dtorch mesh: an unmodified Hugging Face ``LlamaForCausalLM`` (Mistral / Qwen2 module names too) under
DP + TP + PP + CP, HF's own ``generate`` with its KV cache, per-shard weight loading, and ``dtorch llama``.
See ``docs/llama.md``."""

from __future__ import annotations

from torch_dtorch.apps.llama.parallelize import LLAMA_TP_PLAN, LlamaLayout, llama_tp_plan, parallelize_llama

__all__ = ["LLAMA_TP_PLAN", "LlamaLayout", "llama_tp_plan", "parallelize_llama"]
