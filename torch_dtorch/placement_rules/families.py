"""Imports every rule family module so that their decorators register the rules."""

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
    "normalization",
    "attention",
    "embedding",
    "creation",
    "misc",
    "indexing",
    "sorting",
    "spatial",
    "fallback",
)

for _name in FAMILIES:
    importlib.import_module(f"torch_dtorch.placement_rules.{_name}")

# in-place variants (add_, mul_, copy_, ...) derive from the functional rules registered above
from torch_dtorch.placement_rules.inplace import register_inplace_variants  # noqa: E402

register_inplace_variants()
