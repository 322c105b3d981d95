"""Signature builder, per-axis matcher, registry and the rule-checking harness itself."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample
from torch_dtorch._compat import has_kernel_for_dispatch_key
from torch_dtorch.config import RedistributePolicy
from torch_dtorch.errors import NoRuleError, PlacementMismatchError, RuleRegistrationError
from torch_dtorch.placement import Partial, Replicate, Shard, parse_placements
from torch_dtorch.placement_rules import (
    SignatureBuilder,
    get_rule,
    register_rule,
    sig,
    unregister_rule,
)

aten = torch.ops.aten
R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def test_builder_and_str() -> None:
    s = SignatureBuilder().add_input(S0).add_optional_input(R).add_output(S0).build()
    assert str(s) == "(S(0), R?) -> S(0)"
    assert s.matches([S0, None]) and not s.matches([R, R])
    assert str(sig([P, P], P)) == "(P(sum), P(sum)) -> P(sum)"
    with pytest.raises(ValueError, match="at least one output"):
        SignatureBuilder().add_input(R).build()


def pl(text: str):
    return parse_placements(text)


def test_exact_match_keeps_shards() -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    plan = check_sample(aten.add.Tensor, Sample((x, y)), (2, 2), [pl("S(0)S(1)"), pl("S(0)S(1)")])
    assert plan.out_placements == (pl("S(0)S(1)"),)
    assert plan.match.in_targets == (pl("S(0)S(1)"), pl("S(0)S(1)"))


def test_replicate_aligns_to_sharded_peer_for_free() -> None:
    x, b = torch.randn(6, 5), torch.randn(5)
    plan = check_sample(aten.add.Tensor, Sample((x, b)), (2,), [pl("S(1)"), pl("R")])
    assert plan.match.in_targets == (pl("S(1)"), pl("S(0)"))
    assert plan.out_placements == (pl("S(1)"),)


def test_partial_linearity() -> None:
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    assert check_sample(
        aten.add.Tensor, Sample((x, y)), (3,), [pl("P(sum)"), pl("P(sum)")]
    ).out_placements == (pl("P(sum)"),)
    plan = check_sample(aten.mul.Tensor, Sample((x, y)), (3,), [pl("P(sum)"), pl("R")])
    assert plan.out_placements == (pl("P(sum)"),)
    # relu is not linear: the Partial input is reduced first (result still right, checked by check_sample);
    # a reduce-scatter moves half the bytes of an all-reduce, so the cost order picks S(0)
    plan = check_sample(aten.relu.default, Sample((x,)), (3,), [pl("P(sum)")])
    assert plan.match.in_targets == (pl("S(0)"),) and plan.out_placements == (pl("S(0)"),)
    # P + R: the Replicate operand is zero-filled into a Partial for free (R -> P), so the sum stays Partial
    plan = check_sample(aten.add.Tensor, Sample((x, y)), (2,), [pl("P(sum)"), pl("R")])
    assert plan.match.in_targets == (pl("P(sum)"), pl("P(sum)")) and plan.out_placements == (pl("P(sum)"),)


def test_policy_never_raises_with_signatures_listed() -> None:
    x = torch.randn(5, 3)
    with pytest.raises(PlacementMismatchError) as e:
        check_sample(aten.relu.default, Sample((x,)), (2,), [pl("P(sum)")], policy=RedistributePolicy.NEVER)
    msg = str(e.value)
    assert "aten.relu.default" in msg and "f32[5, 3] P(sum)" in msg
    assert "(S(0)) -> S(0)" in msg and "(R) -> R" in msg and "fix:" in msg


def test_policy_local_allows_only_slices() -> None:
    x, b = torch.randn(6, 5), torch.randn(5)
    plan = check_sample(
        aten.add.Tensor, Sample((x, b)), (2,), [pl("S(1)"), pl("R")], policy=RedistributePolicy.LOCAL
    )
    assert plan.out_placements == (pl("S(1)"),)
    with pytest.raises(PlacementMismatchError, match="DTORCH_REDISTRIBUTE=local"):
        check_sample(aten.relu.default, Sample((x,)), (2,), [pl("P(sum)")], policy=RedistributePolicy.LOCAL)


def test_registry_errors() -> None:
    with pytest.raises(RuleRegistrationError, match="already has a rule"):
        register_rule(aten.relu.default, family="pointwise")(lambda call: [])
    with pytest.raises(RuleRegistrationError, match="not a dispatcher overload"):
        register_rule(aten.relu, family="pointwise")(lambda call: [])
    with pytest.raises(NoRuleError, match="no placement rule for aten.bincount.default"):
        get_rule(aten.bincount.default)


def test_harness_catches_a_wrong_rule() -> None:
    """A planted wrong signature (relu is not linear) must make the generic check fail."""
    good = unregister_rule(aten.relu.default)
    try:
        register_rule(aten.relu.default, family="pointwise")(lambda call: [sig([P], P)])
        with pytest.raises(AssertionError):
            check_sample(aten.relu.default, Sample((torch.randn(5, 3),)), (2,), [pl("P(sum)")])
    finally:
        unregister_rule(aten.relu.default)
        register_rule(aten.relu.default, family="pointwise")(good)


def test_intercepted_composites() -> None:
    """Every CompositeImplicitAutograd op with a rule must be on the intercept list, or its rule never fires."""
    from torch_dtorch.placement_rules import intercept_list, registered_ops

    intercepted = set(intercept_list())
    missing = [
        str(op)
        for op in registered_ops()
        if not isinstance(op, str)
        and has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd")
        and op not in intercepted
    ]
    assert not missing, f"CompositeImplicitAutograd ops with a rule but not intercepted: {missing}"
