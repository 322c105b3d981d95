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


def test_saved_rows_report_as_one_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows of separate runs (``--save``) print as one table with the targets (``--report``); a target whose rows
    were not run says so."""
    spec = importlib.util.spec_from_file_location("flux_gpu_report", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    common = ["--tiny", "--steps", "2", "--warmup", "0", "--repeat", "1"]
    assert bench.main([*common, "--modes", "diffusers", "--save", str(tmp_path / "a.pt")]) == 0
    assert bench.main([*common, "--modes", "dtorch", "--save", str(tmp_path / "b.pt")]) == 0
    capsys.readouterr()
    assert bench.main(["--report", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert rows["diffusers"][3] == "1.000" and float(rows["dtorch"][-1]) < 1e-4, rows
    assert (
        "dtorch-compiled / inductor, whole step" in out
        and "not run (inductor and dtorch-compiled missing)" in out
    )
    assert "not run (--quant fp8 --cache-skip 0.5)" in out


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_compiled_pipeline_compiles_like_inductor(model: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``bench/compile_parity.py --path pipeline``: the pipeline compiled by dtorch (``ExecuteConfig(compile=True)``
    on a 1-device mesh) lowers no more kernels, copies or buffers than ``torch.compile`` of its transformer, and the
    same extern calls and static inputs (SD3's 1.03 x inductor on an H100 is then host time, not compiled code)."""
    spec = importlib.util.spec_from_file_location("compile_parity", BENCH.parent / "compile_parity.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--model", model, "--path", "pipeline", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "parity: dtorch compiles no more kernels / copies than inductor" in out, out
    rows = {
        line.rsplit(maxsplit=3)[0].strip(): line.split()[-3:]
        for line in out.splitlines()
        if line.endswith("+0")
    }
    assert "static inputs" in rows and int(rows["static inputs"][0]) > 0, (
        out
    )  # the capture saw the workers' compile
