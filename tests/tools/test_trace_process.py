"""``dt.profile`` in process mode: every worker process records its own spans (``ProfileControl``) and ships them to
the controller at the end of the block, on the controller's timeline; a worker that dies mid-profile costs a
warning, not a hang. One 2-worker cluster for the module (process start-up is the slow part); the test that kills a
worker runs last."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torch_dtorch as dt
from tests.tools.test_trace import validate_trace
from torch_dtorch import Replicate, Shard
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.device.state import get_session
from torch_dtorch.tools import remote_profile
from torch_dtorch.tools.spans import Span, span_from_dict, span_to_dict

pytestmark = pytest.mark.slow

os.environ.setdefault(
    "OMP_NUM_THREADS", "1"
)  # inherited by the worker processes: tiny kernels, 2 shared cores


@pytest.fixture(scope="module")
def mesh() -> Iterator[dt.DeviceMesh]:
    dt.shutdown()  # a thread-mode pool of an earlier module would be replaced anyway
    yield dt.init_device_mesh("cpu", (2,), mode="process")
    dt.shutdown()


def worker_pids() -> dict[int, int]:
    r = get_session().executor.runner
    assert isinstance(r, ClusterRunner)
    return {d: m.proc.pid for d, m in r.members.items() if m.proc is not None}  # type: ignore[misc]


def work(mesh: dt.DeviceMesh) -> torch.Tensor:
    x = dt.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    w = dt.distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    y = (torch.tanh(x @ w) * 2).redistribute(mesh, [Replicate()])
    return y.full_tensor()


def test_worker_processes_record_their_spans(mesh: dt.DeviceMesh, tmp_path: Path) -> None:
    work(mesh)  # warm-up: first-call planning on the controller is not what this test looks at
    path = tmp_path / "trace.json"
    with dt.profile(path) as prof:
        work(mesh)
    pids = worker_pids()
    assert set(prof.workers) == {0, 1}, prof.workers
    for d, w in prof.workers.items():  # recorded in the worker processes, on this host's clock
        assert w.pid == pids[d] and w.pid != os.getpid() and w.shared_clock and w.offset == 0.0, w
    for d in (0, 1):
        mine = [s for s in prof.spans if s.device == d]
        names = [s.name for s in mine]
        assert {"aten.matmul", "aten.tanh", "aten.mul.Tensor", "redistribute"} <= set(names), names
        coll = [s for s in mine if s.name == "redistribute"]
        assert coll and all(s.category == "collective" and s.stream == "comm" for s in coll), coll
        order = [n for n in names if n in ("aten.matmul", "aten.tanh", "aten.mul.Tensor", "redistribute")]
        assert order == ["aten.matmul", "aten.tanh", "aten.mul.Tensor", "redistribute"], order  # issue order
        compute = [s for s in mine if s.stream == "compute"]
        assert all(a.end <= b.start for a, b in zip(compute, compute[1:])), compute  # one after the other
        assert all(s.args.get("op_id") is not None for s in mine)
    # inside the block's time window, after its first flush
    assert prof.elapsed > 0 and all(0.0 <= s.start <= s.end <= prof.elapsed for s in prof.spans), prof.elapsed
    first_flush = min(t for t, _ in prof.flushes)
    assert all(s.start >= first_flush for s in prof.spans)
    events = validate_trace(json.loads(path.read_text()))
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert any(e["cat"] == "collective" for e in spans)
    labels = {
        e["pid"]: e["args"]["labels"] for e in events if e["ph"] == "M" and e["name"] == "process_labels"
    }
    assert all(f"pid {pids[d]}" in labels[d] and "shared clock" in labels[d] for d in (0, 1)), labels
    # the hooks of the controller and of the workers are gone: a later block starts empty
    with dt.profile() as again:
        pass
    assert all(s.name != "aten.matmul" for s in again.spans)


def test_other_host_clock_is_estimated(mesh: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker on another host: the offset is estimated from the stop round trip (here the clock is shared, so
    the estimate must be 0 within its error bound) and the spans still land inside the block."""
    monkeypatch.setattr(remote_profile, "_local_host", lambda: "some-other-host")
    with dt.profile() as prof:
        work(mesh)
    assert set(prof.workers) == {0, 1}
    for w in prof.workers.values():
        assert not w.shared_clock and abs(w.offset) <= w.error + 1e-4 and w.error < 1.0, w
    slack = max(w.error for w in prof.workers.values()) + 1e-4
    assert all(-slack <= s.start <= s.end <= prof.elapsed + slack for s in prof.spans)
    assert {s.device for s in prof.spans} == {0, 1}


def test_spans_round_trip_json() -> None:
    s = Span("aten.add.Tensor", "kernel", 1, "compute", 0.5, 0.75, {"op_id": 3})
    back = span_from_dict(json.loads(json.dumps(span_to_dict(s))), shift=0.25)
    assert back == Span("aten.add.Tensor", "kernel", 1, "compute", 0.25, 0.5, {"op_id": 3})


def test_worker_dies_mid_profile(mesh: dt.DeviceMesh, caplog: pytest.LogCaptureFixture) -> None:
    """Runs last (it breaks the module's cluster): the block's end returns within the bound, with a warning, and
    keeps what the controller recorded."""
    pids = worker_pids()
    x = dt.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    caplog.set_level(logging.WARNING, logger="torch_dtorch.tools")
    t0 = time.monotonic()
    with dt.profile(timeout_s=5.0) as prof:
        for _ in range(3):
            x = (x + 1).redistribute(mesh, [Replicate()]).redistribute(mesh, [Shard(0)])
        dt.sync()
        os.kill(pids[1], signal.SIGKILL)
        with contextlib.suppress(dt.errors.DTorchError):  # queued for a dead worker (or refused at once)
            x = x * 2
    elapsed = time.monotonic() - t0
    assert elapsed < 8.0, f"the profile's end took {elapsed:.1f} s"
    assert any("dtorch.profile" in r.getMessage() for r in caplog.records), caplog.text
    assert prof.flushes  # the controller's own record is kept
    assert all(s.device in (0, 1) for s in prof.spans)
    # let the runner's failure clean-up start before the module's shutdown (ClusterRunner.shutdown may join its
    # abort thread between creating and starting it)
    runner = get_session().executor.runner
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and (runner._abort is None or runner._abort.ident is None):
        time.sleep(0.01)
