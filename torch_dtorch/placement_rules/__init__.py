"""Layer 2a — placement rules: the machinery (signature builder, per-axis matcher, rule registry, a rule's local run
on each rank in :mod:`.ranks`), the rules (:mod:`.families`, one module per op family) and the redistribute planner
(:mod:`.redistribute`).

Importing this package registers every built-in rule.
"""

from __future__ import annotations

# every family registers its rules at import
from torch_dtorch.placement_rules import families as _families  # noqa: F401
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.rule import (
    FunctionRule,
    OpPlan,
    OpRule,
    get_rule,
    intercept_list,
    register_rule,
    registered_ops,
    rules_by_family,
    unregister_rule,
)
from torch_dtorch.placement_rules.signature import PlacementSignature, SignatureBuilder, all_replicate, sig

__all__ = [
    "FunctionRule",
    "LocalContext",
    "OpCall",
    "OpPlan",
    "OpRule",
    "PlacementSignature",
    "SignatureBuilder",
    "all_replicate",
    "get_rule",
    "intercept_list",
    "register_rule",
    "registered_ops",
    "rules_by_family",
    "sig",
    "unregister_rule",
]
