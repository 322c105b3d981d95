"""``dt.profile``: Chrome trace-event JSON that validates against the format, and a 2-stage pipeline whose
micro-batches visibly overlap across the stages' workers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import torch_dtorch as dt
from tests.eager.conftest import thread_only
from tests.tools.conftest import init_mesh
from torch_dtorch.executor.instructions import RunOp
from torch_dtorch.nn.pipeline import pipeline_forward, pipeline_parallel
from torch_dtorch.runtime import op_runner as kernel_mod

REQUIRED = {"ph", "ts", "pid", "tid", "name"}
PHASES = {"X", "B", "E", "i", "I", "M", "C"}


def validate_trace(obj: Any) -> list[dict[str, Any]]:
    """The trace-event format (JSON object form): required keys, numeric times, ``dur`` >= 0 on ``X`` events."""
    assert isinstance(obj, dict) and isinstance(obj.get("traceEvents"), list)
    for ev in obj["traceEvents"]:
        missing = REQUIRED - ev.keys()
        assert not missing, f"{ev} lacks {missing}"
        assert ev["ph"] in PHASES, ev
        assert isinstance(ev["name"], str) and isinstance(ev["ts"], int | float)
        assert isinstance(ev["pid"], int) and isinstance(ev["tid"], int)
        if ev["ph"] == "X":
            assert isinstance(ev.get("dur"), int | float) and ev["dur"] >= 0, ev
        if ev["ph"] in ("i", "I"):
            assert ev.get("s", "t") in ("g", "p", "t"), ev
    return list(obj["traceEvents"])


def test_validator_rejects_bad_events() -> None:
    for bad in (
        {"ph": "X", "ts": 0, "pid": 0, "tid": 0, "name": "a"},
        {"ph": "X", "ts": 0, "pid": 0, "name": "a"},
    ):
        try:
            validate_trace({"traceEvents": [bad]})
        except AssertionError:
            continue
        raise AssertionError(f"accepted {bad}")


class Chain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@thread_only
def test_pipeline_trace_overlaps_stages(tmp_path: Path) -> None:
    delay = 0.05
    torch.manual_seed(0)
    model = Chain(2).eval()
    stages = pipeline_parallel(model, init_mesh((2,), mesh_dim_names=("pp",)))

    def slow(instr: object, device: int) -> None:
        if isinstance(instr, RunOp) and "linear" in str(instr.node.op):
            time.sleep(delay)

    kernel_mod.before_hooks.append(slow)
    path = tmp_path / "trace.json"
    with dt.profile(path) as prof, torch.no_grad():
        pipeline_forward(model, torch.randn(8, 8), num_microbatches=4, mesh=stages.meshes[0]).full_tensor()
    events = validate_trace(json.loads(path.read_text()))
    spans = [e for e in events if e["ph"] == "X"]
    linear = {d: [e for e in spans if e["pid"] == d and e["name"] == "aten.linear"] for d in (0, 1)}
    assert len(linear[0]) == 4 and len(linear[1]) == 4, {d: len(v) for d, v in linear.items()}
    assert all(
        e["dur"] >= delay * 1e6 * 0.9 for e in linear[0] + linear[1]
    )  # the slow part is inside the span
    assert any(e["cat"] == "collective" and e["name"] == "redistribute" for e in spans)  # the stage move
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert {(0, "worker 0"), (1, "worker 1"), (-1, "controller")} <= names
    assert any(e["ph"] == "i" and e["name"] == "flush" for e in events)
    overlaps = [
        (a, b)
        for a in linear[0]
        for b in linear[1]
        if a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]
    ]
    assert overlaps, "no stage-0 linear ran while a stage-1 linear ran: the micro-batches did not overlap"
    png = prof.save_gantt(tmp_path / "gantt.png")
    assert png.stat().st_size > 1000
    # the hooks are gone after the block
    assert prof._before not in kernel_mod.before_hooks and prof._after not in kernel_mod.after_hooks


@thread_only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA event timing needs a GPU")
def test_cuda_spans_are_timed_with_events() -> None:
    """On CUDA workers the kernel spans are measured by events on the workers' streams (``timer: cuda``): a big
    matmul's span is at least as long as the device took for it, not the microseconds of the asynchronous launch."""
    mesh = dt.init_device_mesh("cuda", (2,), simulate=True)
    a = dt.distribute_tensor(torch.randn(4096, 4096, device="cuda"), mesh, [dt.Shard(0)])
    b = dt.distribute_tensor(torch.randn(4096, 4096, device="cuda"), mesh, [dt.Replicate()])
    (a @ b).full_tensor()  # warm-up (cuBLAS handles, allocator)
    with dt.profile() as prof:
        c = a @ b
        for _ in range(3):
            c = c @ b
        c.full_tensor()
    spans = [s for s in prof.spans if s.name == "aten.matmul"]  # kept whole (a composite)
    assert len(spans) == 8, [s.name for s in prof.spans]
    assert all(s.args.get("timer") == "cuda" for s in spans), [s.args for s in spans]
    # 2 * 2048 * 4096^2 flop on one H200 at fp32 is >= 0.1 ms, a launch a few microseconds
    assert all(s.duration >= 1e-4 for s in spans), [s.duration for s in spans]
    for d in (0, 1):  # one compute stream per worker: its kernels follow one another
        mine = sorted((s for s in spans if s.device == d), key=lambda s: s.start)
        assert all(x.end <= y.start + 1e-5 for x, y in zip(mine, mine[1:])), [(s.start, s.end) for s in mine]


@thread_only
def test_a_late_worker_timeline_is_dropped_from_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that only answers after ``collect``'s deadline: its timeline is skipped with a warning and taken out
    of the store when it arrives (it used to stay there for the rest of the run)."""
    from torch_dtorch.device.state import get_session
    from torch_dtorch.tools import remote_profile

    mesh = init_mesh((2,))
    ex = get_session().executor
    store = ex.runner.store
    x = dt.distribute_tensor(torch.ones(4), mesh, [dt.Shard(0)])
    dt.sync()
    before = len(store)
    pid = remote_profile.start(ex, time.perf_counter())

    def slow(instr: Any, device: int) -> None:
        if device == 1:
            time.sleep(0.6)

    kernel_mod.before_hooks.append(slow)
    try:
        y = x + 1  # worker 1 is busy for 0.6 s: its stop reply comes after the 0.1 s deadline
        spans, clocks = remote_profile.collect(ex, pid, timeout_s=0.1)
    finally:
        kernel_mod.before_hooks.remove(slow)
    assert 1 not in clocks
    dt.sync()  # worker 1 has now put its (late) timeline in the store
    deadline = time.monotonic() + 5.0
    while len(store) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(store) == before
    assert y.full_tensor().tolist() == [2.0] * 4
