"""Where a GPU waits for its host: one profiled call, summarized as GPU busy time, idle gaps and top kernels.

``trace_call(fn, sync=..., label=..., out_dir=...)`` runs ``fn`` once under ``torch.profiler`` (CPU and CUDA
activities; every thread of this process — thread-mode workers included, process-mode workers are other processes
and are not seen), writes the Chrome trace to ``out_dir`` when given, and logs:

- wall time, GPU busy time (the union of kernel and memcpy/memset intervals) and their ratio — a GPU-bound call is
  close to 100 %;
- the largest idle gaps, each with the kernel after it, its launch delay (kernel start − launch call) and the CPU ops
  enclosing that launch on its thread: a gap followed by a kernel that started right after its launch is host time
  (the host was late); a long launch delay means the queue was full (the GPU was late);
- the kernels by total time (what the GPU did).

The summary is computed from the Chrome trace's events (``cat`` ``kernel`` / ``gpu_memcpy`` / ``gpu_memset`` on the
GPU, ``cuda_runtime`` launches and ``cpu_op`` spans on host threads, joined by ``args.correlation``), which is the
format torch 2.11–2.13 write.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, NamedTuple

log = logging.getLogger("bench.gpu_trace")

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


class Gap(NamedTuple):
    """An idle stretch of the GPU before ``kernel`` (µs), with what the host was doing when it was launched."""

    idle_us: float
    kernel: str
    launch_delay_us: float
    host_ops: tuple[str, ...]


class TraceSummary(NamedTuple):
    wall_ms: float
    busy_ms: float
    kernels: int
    gaps: list[Gap]
    top_kernels: list[tuple[str, float, int]]  # name, total ms, count

    def lines(self, label: str, *, top: int = 12) -> list[str]:
        busy = 100.0 * self.busy_ms / self.wall_ms if self.wall_ms else float("nan")
        idle = sum(g.idle_us for g in self.gaps) / 1e3
        out = [
            f"{label}: wall {self.wall_ms:.2f} ms, GPU busy {self.busy_ms:.2f} ms ({busy:.1f} %), {self.kernels} "
            f"kernels, idle in gaps >= 20 us: {idle:.2f} ms in {len(self.gaps)} gaps",
            f"{label}: largest gaps (idle us | launch delay us | next kernel | host ops at its launch):",
        ]
        for g in sorted(self.gaps, key=lambda g: -g.idle_us)[:top]:
            ops = " > ".join(g.host_ops[-3:]) or "-"
            out.append(f"  {g.idle_us:9.1f} | {g.launch_delay_us:9.1f} | {g.kernel[:60]} | {ops[:120]}")
        out.append(f"{label}: top kernels (total ms | count | name):")
        out += [f"  {ms:9.2f} | {n:6d} | {name[:100]}" for name, ms, n in self.top_kernels[:top]]
        return out


def summarize(events: list[dict[str, Any]], *, wall_ms: float, min_gap_us: float = 20.0) -> TraceSummary:
    """The summary of a Chrome trace's ``traceEvents`` (see the module docstring)."""
    gpu = sorted(
        (e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: float(e["ts"])
    )
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") in ("cuda_runtime", "cuda_driver")  # Triton launches through the driver API
        and "correlation" in e.get("args", {})
    }
    spans: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)  # per (pid, tid): cpu_op spans
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation"):
            ts = float(e["ts"])
            spans[(e.get("pid"), e.get("tid"))].append((ts, ts + float(e.get("dur", 0)), str(e.get("name"))))
    starts = {k: [s[0] for s in sorted(v)] for k, v in spans.items()}
    ordered = {k: sorted(v) for k, v in spans.items()}

    def host_ops(launch: dict[str, Any] | None) -> tuple[str, ...]:
        if launch is None:
            return ()
        key, ts = (launch.get("pid"), launch.get("tid")), float(launch["ts"])
        items = ordered.get(key, [])
        hi = bisect.bisect_right(starts.get(key, []), ts)
        # enclosing spans, outermost first (a bounded look-back keeps this linear enough for big traces)
        return tuple(name for a, b, name in items[max(0, hi - 400) : hi] if a <= ts <= b)

    busy = 0.0
    gaps: list[Gap] = []
    end = None
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in gpu:
        ts, dur = float(e["ts"]), float(e.get("dur", 0))
        name = str(e.get("name"))
        totals[name][0] += dur / 1e3
        totals[name][1] += 1
        if end is not None and ts - end >= min_gap_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            delay = ts - float(launch["ts"]) if launch is not None else float("nan")
            gaps.append(Gap(ts - end, name, delay, host_ops(launch)))
        if end is None or ts >= end:
            busy += dur
            end = ts + dur
        elif ts + dur > end:
            busy += ts + dur - end
            end = ts + dur
    top = sorted(((n, t[0], int(t[1])) for n, t in totals.items()), key=lambda x: -x[1])
    return TraceSummary(wall_ms, busy / 1e3, len(gpu), gaps, top)


def trace_call(
    fn: Callable[[], Any], *, sync: Callable[[], None], label: str, out_dir: str | None = None
) -> TraceSummary:
    """Run ``fn`` once under the profiler (after ``sync``), log the summary, keep the trace in ``out_dir``."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    directory = out_dir or tempfile.mkdtemp(prefix="gpu_trace_")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{label}.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    if out_dir is None:
        os.remove(path)
    summary = summarize(events, wall_ms=wall_ms)
    for line in summary.lines(label):
        log.info("%s", line)
    return summary
