"""OpInfo conformance: every float32 OpInfo through dtorch on 1-device, 3-device and 2x2 meshes (see harness.py).

An OpInfo passes when every case on every mesh passes (sharded or via fallback); the 1-device mesh must be
bit-identical. Ops in ``EXPECTED_FAILURES`` must fail somewhere — once one passes, remove it from the list.
The default run takes one sample per OpInfo; the ``slow`` run takes three.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conformance.expected_failures import EXPECTED_FAILURES, MORE_SAMPLES_FAILURES
from tests.conformance.harness import Status, conformance_opinfos, init_meshes, op_key, run_opinfo

OPINFOS = conformance_opinfos()
KEYS = [op_key(o) for o in OPINFOS]


@pytest.fixture(scope="module")
def meshes() -> Iterator[dict[tuple[int, ...], Any]]:
    yield init_meshes()


def test_expected_failures_name_real_opinfos() -> None:
    stale = sorted((set(EXPECTED_FAILURES) | set(MORE_SAMPLES_FAILURES)) - set(KEYS))
    assert not stale, f"expected_failures.py lists OpInfos that do not exist: {stale}"
    assert not set(EXPECTED_FAILURES) & set(MORE_SAMPLES_FAILURES), "an OpInfo is listed twice"
    assert all(reason.strip() for reason in (*EXPECTED_FAILURES.values(), *MORE_SAMPLES_FAILURES.values())), (
        "every expected failure needs a reason"
    )


def _check(info: Any, meshes: dict[tuple[int, ...], Any], cap: int) -> None:
    key = op_key(info)
    expected = EXPECTED_FAILURES if cap == 1 else {**EXPECTED_FAILURES, **MORE_SAMPLES_FAILURES}
    results = run_opinfo(info, meshes, cap)
    failing = [r for r in results if not r.status.passed]
    wrong = [r for r in results if r.status is Status.WRONG]
    if key in expected:
        assert failing, (
            f"{key} passes on every mesh now: remove it from tests/conformance/expected_failures.py"
        )
        if wrong and not expected[key].startswith("WRONG"):
            pytest.fail(f"{key}: listed as '{expected[key]}', but now gives a WRONG value: {wrong}")
        return
    lines = []
    for r in failing:
        f = r.first_failure()
        assert f is not None
        lines.append(
            f"mesh {r.mesh}: {r.status.value} (sample {f.sample}, inputs {f.placements}): {f.detail}"
        )
    assert not failing, f"{key}:\n" + "\n".join(lines)


@pytest.mark.parametrize("info", OPINFOS, ids=KEYS)
def test_opinfo(info: Any, meshes: dict[tuple[int, ...], Any]) -> None:
    _check(info, meshes, cap=1)


@pytest.mark.slow
@pytest.mark.parametrize("info", OPINFOS, ids=KEYS)
def test_opinfo_more_samples(info: Any, meshes: dict[tuple[int, ...], Any]) -> None:
    _check(info, meshes, cap=3)
