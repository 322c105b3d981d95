"""The eager fast path on a tiny FLUX transformer step (issue 20): after the first step, the calls still planned in
full per step, and ``bench/eager_flux.py`` at tiny size (runs, bit-identical to torch eager)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import Counter
from types import ModuleType

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_DEVICE, TEST_MODE

pytest.importorskip("diffusers")

_BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench")

#: calls planned in full per tiny FLUX step (1 double + 1 single block) once the fast path is warm (issue 20: 0;
#: it was 36 before ``cat``/``stack``, ``to``, and ``arange`` and its consumers took the fast path)
PLANNED_PER_STEP = 0
#: ops the workers still run on their general local path per step (thread mode): none — ``cat``/``stack``, ``to``,
#: ``dropout``, ``arange`` and (without context parallelism) ``scaled_dot_product_attention`` are replayed
GENERAL_PER_STEP: dict[str, int] = {}


def _bench_module(name: str) -> ModuleType:
    sys.path.insert(0, _BENCH)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(_BENCH, f"{name}.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(_BENCH)


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the tiny widths are for the CPU")
def test_planned_calls_per_tiny_flux_step() -> None:
    """After the first step every call of the step is a fast-path hit, and (thread mode) the workers replay every
    op but attention."""
    bench = _bench_module("compile_flux_gpu")
    config = dict(bench.TINY, num_layers=1, num_single_layers=1)
    cpu = torch.device("cpu")
    model = bench.build_model(config, cpu, torch.float32)
    inputs = bench.make_inputs(config, 16, 8, cpu, torch.float32)
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        mesh = dt.init_device_mesh("cpu", (1,), mode=TEST_MODE)
        bench.distribute_module(model, mesh)
        din = {k: dt.distribute_tensor(v, mesh) for k, v in inputs.items()}
        model(**din, return_dict=False)  # the first step plans every call and teaches the fast path
        executor = dt.device.state.get_session().executor
        constructor = executor.constructor
        workers = [  # (the pool may hold more workers than this mesh; process mode: none in this process)
            w for w in getattr(executor.runner, "workers", {}).values() if w.device in mesh.devices
        ]
        dt.sync()
        general = [Counter(w.general) for w in workers]
        before = constructor.num_planned
        out = model(**din, return_dict=False)[0]
        planned = constructor.num_planned - before
        dt.sync()
    assert torch.equal(out.full_tensor(), ref)
    assert planned <= PLANNED_PER_STEP, planned  # a rise is a fast-path regression
    for w, g in zip(workers, general, strict=True):
        assert dict(Counter(w.general) - g) == GENERAL_PER_STEP, (w, dict(Counter(w.general) - g))


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the tiny widths are for the CPU")
def test_eager_flux_bench_runs_at_tiny_size() -> None:
    bench = _bench_module("eager_flux")
    result = bench.main(
        ["--device", "cpu", "--mode", TEST_MODE, "--layers", "1", "1", "--rounds", "1", "--steps", "1",
         "--warmup", "1", "--image-tokens", "16", "--text-tokens", "8"]
    )  # fmt: skip
    assert result["bit_identical"] is True
    assert result["hits"] > 0 and result["torch_ms"] > 0 and result["dtorch_ms"] > 0
    assert result["planned"] <= PLANNED_PER_STEP
    if TEST_MODE == "thread":
        assert result["worker_general"] == GENERAL_PER_STEP
