"""``bench/flux_gpu.py --tiny`` runs every dtorch path of the benchmark on the CPU and prints the table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

BENCH = Path(__file__).resolve().parents[3] / "bench" / "flux_gpu.py"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_tiny_bench_runs(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("flux_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--tiny", "--model", model, "--modes", "diffusers", "dtorch", "ulysses4", "--steps", "2"]
    assert bench.main([*argv, "--warmup", "1", "--repeat", "1"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    for mode in ("diffusers", "dtorch", "ulysses4"):
        assert float(rows[mode][-1]) < 1e-4, rows[mode]  # the latents agree with diffusers
    assert rows["dtorch"][-2] == rows["ulysses4"][-2] == "1", rows  # one fetch per call, not one per step
