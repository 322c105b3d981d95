"""In-place and ``out=`` conformance (see variants.py) on the 3-device mesh with sharded inputs.

The default run covers a representative set (``INPLACE_OPS``: pointwise, index/scatter, matmul, view-changing
in-place ops; ``OUT_OPS``: pointwise, matmul, reductions, multi-output, joins, index ops); the ``slow`` run covers
every other float32 OpInfo with an in-place variant or ``out=``. Ops in ``INPLACE_FAILURES`` / ``OUT_FAILURES``
must fail — once one passes, remove it from the list.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conformance.expected_failures import INPLACE_FAILURES, OUT_FAILURES
from tests.conformance.harness import conformance_opinfos, init_meshes, op_key
from tests.conformance.variants import VariantCase, run_inplace, run_out

MESH = (3,)

INPLACE_OPS = (
    "abs", "add", "addcdiv", "addcmul", "addmm", "atan2", "baddbmm", "clamp", "cumprod", "cumsum",
    "div.no_rounding_mode", "eq", "exp", "fill", "floor_divide", "index_add", "index_copy", "index_fill",
    "index_put", "lerp", "logit", "masked_fill", "masked_scatter", "mul", "nan_to_num", "neg",
    "nn.functional.elu", "nn.functional.leaky_relu", "nn.functional.threshold", "pow", "renorm",
    "round.decimals_3", "scatter", "scatter_add", "scatter_reduce.sum", "sigmoid", "squeeze", "sub", "t",
    "transpose", "tril", "unsqueeze", "xlogy", "zero_",
)  # fmt: skip
OUT_OPS = (
    "abs", "add", "addmm", "amax", "bmm", "clamp", "cummax", "cumsum", "gather", "index_select", "linalg.vector_norm",
    "logaddexp", "matmul", "max.reduction_with_dim", "mean", "mm", "mul", "softmax", "sort", "topk", "tril", "var",
    "where",
)  # fmt: skip

_INFOS = {op_key(o): o for o in conformance_opinfos()}
_ALL_INPLACE = [k for k, o in _INFOS.items() if o.inplace_variant is not None]
_ALL_OUT = [k for k, o in _INFOS.items() if o.supports_out]


@pytest.fixture(scope="module")
def mesh() -> Iterator[Any]:
    yield init_meshes((MESH,))[MESH]


def test_lists_name_real_variants() -> None:
    assert set(INPLACE_OPS) <= set(_ALL_INPLACE), set(INPLACE_OPS) - set(_ALL_INPLACE)
    assert set(OUT_OPS) <= set(_ALL_OUT), set(OUT_OPS) - set(_ALL_OUT)
    assert set(INPLACE_FAILURES) <= set(_ALL_INPLACE), set(INPLACE_FAILURES) - set(_ALL_INPLACE)
    assert set(OUT_FAILURES) <= set(_ALL_OUT), set(OUT_FAILURES) - set(_ALL_OUT)
    assert all(r.strip() for r in (*INPLACE_FAILURES.values(), *OUT_FAILURES.values()))


def _check(key: str, cases: list[VariantCase], expected: dict[str, str]) -> None:
    failing = [c for c in cases if not c.status.passed]
    if key in expected:
        assert failing, f"{key} passes now: remove it from tests/conformance/expected_failures.py"
        return
    if not cases:
        pytest.skip(f"{key}: torch accepts none of the first samples in this form")
    lines = [f"{c.kind} {c.placements}: {c.status.value}: {c.detail}" for c in failing]
    assert not failing, f"{key}:\n" + "\n".join(lines)


@pytest.mark.parametrize("key", INPLACE_OPS)
def test_inplace(key: str, mesh: Any) -> None:
    _check(key, run_inplace(_INFOS[key], mesh), INPLACE_FAILURES)


@pytest.mark.parametrize("key", OUT_OPS)
def test_out(key: str, mesh: Any) -> None:
    _check(key, run_out(_INFOS[key], mesh), OUT_FAILURES)


@pytest.mark.slow
@pytest.mark.parametrize("key", [k for k in _ALL_INPLACE if k not in INPLACE_OPS])
def test_inplace_all(key: str, mesh: Any) -> None:
    _check(key, run_inplace(_INFOS[key], mesh), INPLACE_FAILURES)


@pytest.mark.slow
@pytest.mark.parametrize("key", [k for k in _ALL_OUT if k not in OUT_OPS])
def test_out_all(key: str, mesh: Any) -> None:
    _check(key, run_out(_INFOS[key], mesh), OUT_FAILURES)
