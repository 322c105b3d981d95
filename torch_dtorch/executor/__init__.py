"""Layer 3 — graph executor. ``GraphConstructor`` records operators; runners (threads, processes) execute them."""

from __future__ import annotations

from torch_dtorch.executor.constructor import GraphConstructor

__all__ = ["GraphConstructor"]
