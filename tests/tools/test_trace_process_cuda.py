"""``dt.profile`` in process mode on CUDA: two worker processes sharing one GPU (``simulate=True``) record their
spans (CUDA work timed on their streams) and ship them to the controller, as on the CPU."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torch_dtorch as dt
from tests.tools.test_trace import validate_trace
from tests.tools.test_trace_process import work

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def mesh() -> Iterator[dt.DeviceMesh]:
    dt.shutdown()
    yield dt.init_device_mesh("cuda", (2,), simulate=True, mode="process")
    dt.shutdown()


def test_cuda_worker_processes_record_their_spans(mesh: dt.DeviceMesh, tmp_path: Path) -> None:
    work(mesh)  # warm-up
    path = tmp_path / "trace.json"
    with dt.profile(path) as prof:
        out = work(mesh)
    assert out.shape == (8, 4)
    assert set(prof.workers) == {0, 1}, prof.workers
    for d in (0, 1):
        names = [s.name for s in prof.spans if s.device == d]
        assert {"aten.matmul", "aten.tanh", "aten.mul.Tensor", "redistribute"} <= set(names), names
    assert prof.elapsed > 0 and all(0.0 <= s.start <= s.end <= prof.elapsed for s in prof.spans)
    events = validate_trace(json.loads(path.read_text()))
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}
