"""The rule families: one module per op family, each registering its rules with decorators at import.

Importing this package imports every family (this order: a later family may look up an earlier one's rules), then
derives the in-place variants from the functional rules."""

from __future__ import annotations

import importlib

FAMILIES = (
    "pointwise",
    "matmul",
    "reduction",
    "norm_comm",
    "loss",
    "view",
    "view_scatter",
    "shape",
    "cat",
    "normalization",
    "attention",
    "attention_backward",
    "embedding",
    "creation",
    "misc",
    "indexing",
    "sorting",
    "spatial",
    "fallback",
    "backward",
    "backward_embedding",
    "complex_views",
    "loss_nll",
    "quantized",
    "fused",
    "foreach",
    "sampling",
)

for _name in FAMILIES:
    importlib.import_module(f"torch_dtorch.placement_rules.families.{_name}")

# in-place variants (add_, mul_, copy_, ...) derive from the functional rules registered above
from torch_dtorch.placement_rules.inplace import register_inplace_variants  # noqa: E402

register_inplace_variants()
