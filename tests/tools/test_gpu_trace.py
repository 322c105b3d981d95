"""``bench/gpu_trace.py``: GPU busy time, idle gaps and the host ops at each late launch, from a Chrome trace."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu_trace.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_trace", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_summary_finds_the_gap_and_the_op_that_launched_late() -> None:
    mod = _module()
    events = [
        # host: an mm launched at 0, then a slow Python op; the add is launched late, at 500
        _x("cpu_op", "aten::mm", 0, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 3, correlation=1),
        _x("cpu_op", "slow_python_op", 20, 600),
        _x("cpu_op", "aten::add", 490, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 500, 3, correlation=2),
        # device (another "thread"): mm 5..105, add 505..515 (overlapping copy 100..110 counts once)
        _x("kernel", "gemm", 5, 100, tid=7, correlation=1),
        _x("gpu_memcpy", "Memcpy DtoD", 100, 10, tid=8),
        _x("kernel", "add_kernel", 505, 10, tid=7, correlation=2),
    ]
    s = mod.summarize(events, wall_ms=1.0)
    assert s.kernels == 3
    assert abs(s.busy_ms - 0.115) < 1e-9  # 5..110 and 505..515
    assert len(s.gaps) == 1
    gap = s.gaps[0]
    assert (gap.idle_us, gap.kernel, gap.launch_delay_us) == (395.0, "add_kernel", 5.0)
    assert gap.host_ops == ("slow_python_op", "aten::add")  # outermost first
    assert s.top_kernels[0] == ("gemm", 0.1, 1)
    text = "\n".join(s.lines("x"))
    assert "GPU busy 0.12 ms (11.5 %)" in text and "slow_python_op > aten::add" in text
