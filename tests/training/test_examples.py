"""examples/tensor_parallelism/: each script runs 2 iterations on a CPU mesh and its parameters equal a
single-device torch twin's (``--check``: the script exits non-zero when any differs by more than 1e-5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tensor_parallelism"


@pytest.mark.parametrize(
    "script,extra",
    [
        ("tensor_parallel_example.py", ["--tp", "2"]),
        ("sequence_parallel_example.py", ["--tp", "3"]),  # uneven: 32 hidden units on 3 ranks
        ("fsdp_tp_example.py", ["--dp", "2", "--tp", "2", "--tiny"]),
    ],
)
def test_example_runs_and_matches_torch(script: str, extra: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--device", "cpu", "--iters", "2", "--check", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "max |dtorch - torch|" in proc.stdout + proc.stderr
