"""``bench/llama_gpu.py --tiny`` runs the dtorch rows of the benchmark on the CPU: greedy tokens equal torch eager's
and the table and ratios are printed (the GPU run is the lead's)."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs transformers (test extra)")

BENCH = Path(__file__).resolve().parents[3] / "bench" / "llama_gpu.py"


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("llama_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.parametrize(
    "variants",
    [
        "torch-eager,dtorch-eager,dtorch-tp2-sim",
        pytest.param("torch-eager,dtorch-compile", marks=pytest.mark.slow),
    ],
    ids=["eager", "compiled"],
)
def test_tiny_bench_runs(variants: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "rows.json"
    argv = [
        "--tiny",
        "--variants",
        variants,
        "--prefill",
        "8",
        "--decode",
        "3",
        "--repeats",
        "1",
        "--json",
        str(out_json),
    ]
    assert _bench().main(argv) == 0  # type: ignore[attr-defined]
    text = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    rows = report["rows"]
    names = variants.split(",")
    assert sorted({r["variant"] for r in rows}) == sorted(names)
    assert all(r["prefill_ms"] > 0 for r in rows)
    for r in rows:
        assert r["tokens_match"] is (None if r["variant"] == "torch-eager" else True), r
    assert "dtorch eager / torch eager decode" in text
    # the targets table: every target at every batch, measured ones met / NOT met, the others not run
    status = {(r["target"], r["batch"]): r["status"] for r in report["ratios"]}
    assert len(status) == 3 * len({r["batch"] for r in rows})
    eager = [s for (t, _), s in status.items() if t.startswith("dtorch eager")]
    prefill = [s for (t, _), s in status.items() if t.endswith("prefill")]
    assert all(s in ("met", "NOT met") for s in eager) == ("dtorch-eager" in names)
    assert all(s == "not run" for s in prefill)  # no torch-compile row in either case
    assert "not run" in text


def test_decode_bench_runs() -> None:
    """``bench/llama_decode.py``: the growing-cat and new-length ``generate`` measurements run (tiny sizes)."""
    spec = importlib.util.spec_from_file_location("llama_decode", BENCH.parent / "llama_decode.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mesh = bench._mesh("")
    assert bench.bench_cat(mesh, 3, 1) > 0
    r = bench.bench_generate(mesh, 2, 1)
    # (the times are differences of two single runs, ``(generate(1 + n) - generate(1)) / n``: at these sizes a loaded
    # machine can make one negative; the figures are checked for being measured, the counts for their values)
    assert r["fetches_per_token"] > 0
    assert math.isfinite(r["new_ms_per_token"]) and math.isfinite(r["seen_ms_per_token"])
