"""``bench/train_gpu.py --tiny`` runs every mode of the training benchmark on the CPU (torch, inductor, dtorch
eager and compiled); in float32 the first step's loss of every mode equals torch's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "train_gpu.py"


def test_tiny_training_bench_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("train_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    modes = list(bench.MODES)  # every mode, inductor included (its first call compiles on the CPU)
    assert {"torch", "inductor", "dtorch", "dtorch-compiled", "dtorch-tp2", "dtorch-dp2"} <= set(modes)
    argv = ["--tiny", "--dtype", "float32", "--modes", *modes, "--warmup", "1", "--repeat", "1"]
    argv += ["--trace", str(tmp_path)]  # one more profiled step per mode: its summary and Chrome trace
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for mode in modes:
        assert f"train-{mode}: wall " in out and (tmp_path / f"train-{mode}.json").is_file(), mode
    rows = {
        cells[1].strip(): cells
        for line in out.splitlines()
        if line.startswith("|") and (cells := line.split("|"))[1:]
    }
    want = float(rows["torch"][5])
    for mode in modes[1:]:
        assert abs(float(rows[mode][5]) - want) < 1e-4, rows[mode]
