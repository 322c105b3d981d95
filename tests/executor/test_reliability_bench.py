"""``bench/reliability.py --short``: every row of the fault and load table passes (issue 18, deliverable 3)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.reliability import main, run  # noqa: E402


@pytest.mark.slow
def test_reliability_bench_short_mode_passes(capsys: pytest.CaptureFixture[str]) -> None:
    rows = run(short=True)
    names = [r.name for r in rows]
    assert names == [
        "fuzz thread",
        "fuzz process",
        "soak thread",
        "soak process",
        "worker SIGKILL",
        "worker SIGSTOP",
        "controller SIGKILL",
        "no dt.shutdown()",
        "bad input",
        "signed-message flood",
    ]
    failed = [f"{r.name}: {r.figure} {r.note}" for r in rows if not r.ok]
    assert not failed, failed


def test_reliability_bench_cli_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--short" in capsys.readouterr().out
