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


SAMPLES = _all_samples()


def test_every_rule_has_samples() -> None:
    missing = [str(op) for op in registered_ops() if op not in SAMPLES]
    assert not missing, f"rules without samples in tests/rules/samples_*.py: {missing}"


@pytest.mark.parametrize("op", sorted(SAMPLES, key=str), ids=str)
def test_rule_matches_torch_on_shards(op: object) -> None:
    assert check_op_samples(op, SAMPLES[op]) > 0
