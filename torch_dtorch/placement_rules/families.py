"""Imports every rule family module so that their decorators register the rules."""

from __future__ import annotations

import importlib

FAMILIES = (
    "pointwise",
    "matmul",
    "reduction",
    "view",
    "shape",
    "normalization",
    "attention",
    "embedding",
    "creation",
    "misc",
)

for _name in FAMILIES:
    try:
        importlib.import_module(f"torch_dtorch.placement_rules.{_name}")
    except ModuleNotFoundError as e:  # a family still being written: keep the package importable
        if e.name != f"torch_dtorch.placement_rules.{_name}":
            raise
