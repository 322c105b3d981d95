"""The mismatch localizer on the 3-block TinyNet: a planted wrong rule is named (block, then aten op); a clean
model reports no mismatch."""

from __future__ import annotations

import pytest
import torch

from tests.eager.conftest import thread_only
from torch_dtorch.tools import localize_mismatch
from torch_dtorch.tools.demo import ACTIVATIONS, build_demo, plant_fault


@pytest.fixture(scope="module")
def demo() -> tuple[object, object, object]:
    return build_demo(tp=2, acts=("relu", "gelu", "silu"))


def test_clean_model_matches(demo: tuple) -> None:  # type: ignore[type-arg]
    model, twin, mesh = demo
    report = localize_mismatch(model, twin, (torch.randn(2, 4, 16),), mesh=mesh)
    assert report.ok and report.modules_checked == 3 * 5 + 2, str(report)  # 5 modules per block, head, root


@thread_only
@pytest.mark.parametrize(("act", "block"), [("gelu", 1), ("silu", 2)])
def test_planted_rule_names_block_and_op(demo: tuple, act: str, block: int) -> None:  # type: ignore[type-arg]
    model, twin, mesh = demo
    op = ACTIVATIONS[act][1]
    with plant_fault(op, device=1, scale=1.01):
        report = localize_mismatch(model, twin, (torch.randn(2, 4, 16),), mesh=mesh)
    assert report.module is not None and report.op is not None, str(report)
    assert report.module.name == f"blocks.{block}", str(report)
    assert report.module.max_abs_error > 1e-4
    assert "R on mesh(tp=2)" in report.module.input_placements[0]
    assert report.op.op == f"aten.{act}", str(report)
    assert f"aten.{act}(" in report.op.line and "S(2)" in report.op.line
    assert report.op.max_rel_error == pytest.approx(0.01, rel=0.05)  # the planted 1.01 scale
    assert f"= aten.{act}(" in report.graph
    # the fault is gone after the context: the model matches again
    assert localize_mismatch(model, twin, (torch.randn(2, 4, 16),), mesh=mesh).ok
