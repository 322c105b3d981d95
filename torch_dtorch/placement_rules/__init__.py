"""Layer 2a — placement rules: signature builder, per-axis matcher, rule registry (one file per family), planner.

Importing this package registers every built-in rule.
"""

from __future__ import annotations

# Families register their rules at import (one module per family).
# isort: off
from torch_dtorch.placement_rules import families as _families  # noqa: E402,F401
from torch_dtorch.placement_rules import backward as _backward  # noqa: E402,F401  (autograd's overloads)
from torch_dtorch.placement_rules import complex_views as _complex_views  # noqa: E402,F401
from torch_dtorch.placement_rules import loss_nll as _loss_nll  # noqa: E402,F401
from torch_dtorch.placement_rules import backward_embedding as _backward_embedding  # noqa: E402,F401

# isort: on
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
