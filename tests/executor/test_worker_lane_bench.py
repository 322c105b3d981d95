"""``bench/worker_lane.py``: the worker's per-op cost without the controller runs and splits its time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torch_dtorch.runtime.native_replay import extension

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(extension() is None, reason="the native worker loop is not built here")
@pytest.mark.parametrize("flags", [[], ["--wire"]])
def test_worker_lane_bench_prints_its_split(flags: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "worker_lane.py"), "--ops", "400", "--repeat", "1", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    ).stdout
    row = out.strip().splitlines()[-1]
    total, kernels, rest = (float(c) for c in row.strip("|").split("|"))
    assert 0 < kernels <= total and abs(total - kernels - rest) < 0.02, out
