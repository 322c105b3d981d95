"""Every registered rule, checked on plain torch shards per placement combination against single-device torch."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import tests.rules as rules_pkg
from tests.rules.harness import Sample, check_op_samples
from torch_dtorch.placement_rules import registered_ops


def _all_samples() -> dict[object, list[Sample]]:
    out: dict[object, list[Sample]] = {}
    for info in pkgutil.iter_modules(rules_pkg.__path__):
        if info.name.startswith("samples_"):
            mod = importlib.import_module(f"tests.rules.{info.name}")
            for op, samples in mod.SAMPLES.items():
                assert op not in out, f"{op} has samples in two modules"
                out[op] = samples
    return out


def _inplace_samples(samples: dict[object, list[Sample]]) -> None:
    """In-place variants reuse their functional op's samples where torch accepts the in-place call (``self``
    must already have the result's shape and a dtype the result casts to)."""
    import torch
    from torch.utils import _pytree as pytree

    from torch_dtorch.placement_rules import get_rule
    from torch_dtorch.placement_rules.inplace import InplaceRule

    for op in registered_ops():
        rule = get_rule(op)
        if not isinstance(rule, InplaceRule) or op in samples:
            continue
        functional = rule.functional_op
        usable = []
        for sample in samples.get(functional, []):
            if not sample.args or not isinstance(sample.args[0], torch.Tensor):
                continue
            args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (sample.args, sample.kwargs))
            try:
                out = op(*args, **kwargs)
            except (RuntimeError, TypeError):
                continue
            if out.shape == sample.args[0].shape:
                usable.append(sample)
        samples[op] = usable


SAMPLES = _all_samples()
_inplace_samples(SAMPLES)


def test_every_rule_has_samples() -> None:
    missing = [str(op) for op in registered_ops() if not SAMPLES.get(op)]
    assert not missing, f"rules without samples in tests/rules/samples_*.py: {missing}"


@pytest.mark.parametrize("op", sorted(SAMPLES, key=str), ids=str)
def test_rule_matches_torch_on_shards(op: object) -> None:
    assert check_op_samples(op, SAMPLES[op]) > 0
