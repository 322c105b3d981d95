"""The KV cache keeps the prefill's placements.

HF's ``DynamicLayer`` starts every layer's cache as ``torch.cat([torch.tensor([]), keys], dim=-2)``. The ``cat`` rule
has no sharded signature for a legacy empty 1-d input next to a 4-d one (``placement_rules/shape.py``), so that
first write would all-gather the prefill's keys and values: the batch (dp), the heads (tp) and the sequence (cp)
of the cache would become replicated, and context-parallel attention would fall back to gathering k/v. The model's
input hook therefore switches each not yet written ``DynamicLayer`` of the cache it is given to
``FirstWriteLayer``, whose first write stores the keys and values as they are (later writes are HF's own
``cat``, which keeps dp/tp sharding; a cp-sharded cache is redistributed by the first decode step's ``cat``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["keep_prefill_placements", "new_cache"]


@functools.cache
def _layer_classes() -> tuple[type, type] | None:
    """(HF's ``DynamicLayer``, :class:`FirstWriteLayer` over it); ``None`` for a transformers without cache layers."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - an older transformers: nothing to adapt
        return None
    base: Any = DynamicLayer

    class FirstWriteLayer(base):  # type: ignore[misc, valid-type]
        """A ``DynamicLayer`` whose first write stores ``key_states`` / ``value_states`` without a ``cat``."""

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            me: Any = self
            if not me.is_initialized:
                me.lazy_initialization(key_states, value_states)
            if me.keys.numel() == 0:
                me.keys, me.values = key_states, value_states
                return key_states, value_states
            out: tuple[torch.Tensor, torch.Tensor] = super().update(key_states, value_states, *args, **kwargs)
            return out

    return DynamicLayer, FirstWriteLayer


def keep_prefill_placements(cache: Any) -> None:
    """Switch every unwritten plain ``DynamicLayer`` of ``cache`` (an HF ``Cache``) to ``FirstWriteLayer``."""
    classes = _layer_classes()
    if classes is None:
        return
    base, first_write = classes
    layers: Any = getattr(cache, "layers", ())
    for layer in layers:
        written: Any = layer
        if type(layer) is base and (not written.is_initialized or written.keys.numel() == 0):
            layer.__class__ = first_write


def new_cache(config: Any) -> Any:
    """The ``DynamicCache`` a model's forward makes when it is given none (``None`` without transformers' caches)."""
    try:
        from transformers.cache_utils import DynamicCache
    except ImportError:  # pragma: no cover
        return None
    return DynamicCache(config=config)
