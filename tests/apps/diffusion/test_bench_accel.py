"""``bench/flux_gpu.py --quant/--fuse/--cache-skip`` on the CPU (``--tiny``): every acceleration row runs, the forced
cache skips half of the steps, and the unquantized rows still agree with diffusers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("diffusers")

BENCH = Path(__file__).resolve().parents[3] / "bench" / "flux_gpu.py"


@pytest.mark.slow
@pytest.mark.parametrize("model,quant", [("flux", "fp8"), ("sd3", "int8")])
def test_tiny_bench_acceleration_rows(model: str, quant: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("flux_gpu_accel", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--tiny", "--model", model, "--modes", "diffusers", "dtorch-compiled", "--steps", "4"]
    argv += ["--quant", quant, "--fuse", "--cache-skip", "0.5", "--warmup", "1", "--repeat", "1"]
    assert bench.main(argv) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    names = [
        f"dtorch-compiled+{quant}",
        f"dtorch-compiled+{quant}+fuse",
        f"dtorch-compiled+{quant}+fuse+cache0.5",
    ]
    for name in ["dtorch-compiled", *names]:
        assert name in rows, rows
    assert rows[names[-1]][-3] == "2/4"  # the skipped column
    assert rows["dtorch-compiled"][-2] == "1"  # fetches per call: the loop stays on the mesh
    assert float(rows["dtorch-compiled"][-1]) < 1e-4  # the unaccelerated row still equals diffusers
    assert float(rows[names[0]][-1]) > 0  # quantized: a different (not broken) result


def test_cudagraphs_rows() -> None:
    """``--cudagraphs`` marks the one-rank compiled rows (named ``+cudagraphs``), not the simulated ulysses4 mesh."""
    spec = importlib.util.spec_from_file_location("flux_gpu_rows", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = bench.parse_args(
        ["--modes", "inductor", "dtorch-compiled", "ulysses4", "--quant", "fp8", "--cudagraphs"]
    )
    names = [r.name for r in bench.rows(args)]
    assert names == [
        "inductor",
        "dtorch-compiled+cudagraphs",
        "dtorch-compiled+fp8+cudagraphs",
        "ulysses4",
        "ulysses4+fp8",
    ]
