"""Timeline: ``dt.profile()`` records per-worker, per-stream kernel spans, collectives and the controller's flush
points, and writes them as Chrome / Perfetto trace-event JSON (open in https://ui.perfetto.dev or
``chrome://tracing``).

Example::

    with dt.profile("trace.json") as prof:
        y = model(x)
        y.full_tensor()
    prof.save_gantt("timeline.png")  # a matplotlib Gantt chart (``pip install matplotlib``)

How it records (thread mode): a hook at the front of ``runtime.kernel.before_hooks`` and one at the end of
``after_hooks`` time every instruction a worker runs (so a slower hook, e.g. a test's injected delay, counts inside
the span). Each span lands on process ``worker <device>``, thread ``compute`` or ``comm`` (the stream the operator
is assigned to); redistributes are category ``collective``, other operators ``kernel``. On CUDA the spans are timed
with CUDA events recorded on the operator's stream (device time, converted to the host clock at the end of the
profile), so asynchronous kernels are measured where they run, not where they were queued. Controller flushes
(a batch handed to the runner) are instant events on process ``controller``.

In process mode (cluster) the worker hooks live in other processes: only the controller's flushes are recorded.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_dtorch.runtime import kernel as kernel_mod

__all__ = ["Profile", "Span", "profile"]

log = logging.getLogger(__name__)

CONTROLLER_PID = -1


@dataclass(frozen=True)
class Span:
    """One operator on one worker: ``start``/``end`` in seconds since the profile began."""

    name: str
    category: str  # "kernel" or "collective"
    device: int
    stream: str
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class Profile:
    """What one :func:`profile` block recorded (``spans``, ``flushes``); export with :meth:`export_chrome_trace`."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.spans: list[Span] = []
        #: (seconds since start, number of instructions in the batch)
        self.flushes: list[tuple[float, int]] = []
        self._t0 = 0.0
        self._open: dict[tuple[int, int], tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self._runner: Any = None
        self._submit: Callable[..., Any] | None = None
        self._cuda: list[tuple[Any, Any, Span]] = []  # (start event, end event, host-timed span)
        self._cuda_ref: dict[int, tuple[Any, float]] = {}

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._t0 = time.perf_counter()
        kernel_mod.before_hooks.insert(0, self._before)
        kernel_mod.after_hooks.append(self._after)
        from torch_dtorch.device.state import runtime_or_none

        rt = runtime_or_none()
        if rt is not None:
            runner = rt.executor.runner
            if getattr(rt, "mode", "thread") != "thread":
                log.warning(
                    "dtorch.profile: worker spans are recorded in thread mode only (mode=%s)", rt.mode
                )
            self._runner, self._submit = runner, runner.submit
            original = runner.submit

            def submit(batch: Any) -> Any:
                self.flushes.append((time.perf_counter() - self._t0, len(batch)))
                return original(batch)

            runner.submit = submit  # instance attribute; removed in stop()

    def stop(self) -> None:
        if self._runner is not None:
            try:
                from torch_dtorch.device.state import runtime_or_none

                rt = runtime_or_none()
                if rt is not None and rt.executor.runner is self._runner:
                    rt.executor.sync()  # every span issued inside the block is finished
            finally:
                if "submit" in vars(self._runner):
                    del self._runner.submit
        for hooks, fn in ((kernel_mod.before_hooks, self._before), (kernel_mod.after_hooks, self._after)):
            if fn in hooks:
                hooks.remove(fn)
        self._resolve_cuda()
        self.spans.sort(key=lambda s: (s.start, s.device))
        if self.path is not None:
            self.export_chrome_trace(self.path)

    # --- hooks (worker threads) ---------------------------------------------------------------------------------
    def _before(self, instr: Any, device: int) -> None:
        now = time.perf_counter()
        ev = self._cuda_event(instr, device)
        self._open[(device, id(instr))] = (now, ev)

    def _after(self, instr: Any, device: int) -> None:
        now = time.perf_counter()
        started = self._open.pop((device, id(instr)), None)
        if started is None:
            return
        node = getattr(instr, "node", instr)
        name = getattr(node, "name", type(instr).__name__)
        collective = name == "redistribute"
        assign = getattr(node, "assign", None)
        stream = assign.stream if assign is not None else ("comm" if collective else "compute")
        args: dict[str, Any] = {"op_id": getattr(node, "id", None)}
        if getattr(node, "note", ""):
            args["plan"] = node.note
        outs = getattr(node, "outputs", None)
        if outs:
            args["out"] = ", ".join(f"{o.type_str()} {o.placements_str}" for o in outs)
        span = Span(
            name, "collective" if collective else "kernel", device, stream, started[0] - self._t0, now - self._t0,
            args,
        )  # fmt: skip
        with self._lock:
            self.spans.append(span)
            if started[1] is not None:
                end = self._record_event(device, stream)
                self._cuda.append((started[1], end, span))

    # --- CUDA ---------------------------------------------------------------------------------------------------
    def _worker_stream(self, device: int, kind: str) -> Any:
        streams = getattr(self._runner, "streams", None)
        ks = streams.get(device) if isinstance(streams, dict) else None
        if ks is None or not ks.is_cuda:
            return None
        return ks.stream(kind)

    def _record_event(self, device: int, kind: str) -> Any:
        import torch

        s = self._worker_stream(device, kind)
        if s is None:
            return None
        if device not in self._cuda_ref:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(s)
            ref.synchronize()
            self._cuda_ref[device] = (ref, time.perf_counter() - self._t0)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(s)
        return ev

    def _cuda_event(self, instr: Any, device: int) -> Any:
        if self._runner is None:
            return None
        node = getattr(instr, "node", None)
        assign = getattr(node, "assign", None)
        kind = assign.stream if assign is not None else "compute"
        return self._record_event(device, kind)

    def _resolve_cuda(self) -> None:
        if not self._cuda:
            return
        import torch

        torch.cuda.synchronize()
        by_span = {id(s): i for i, s in enumerate(self.spans)}
        for start, end, span in self._cuda:
            if end is None:
                continue
            ref, host = self._cuda_ref[span.device]
            t0 = host + ref.elapsed_time(start) / 1e3
            t1 = host + ref.elapsed_time(end) / 1e3
            new = Span(
                span.name, span.category, span.device, span.stream, t0, t1, {**span.args, "timer": "cuda"}
            )
            self.spans[by_span[id(span)]] = new

    # --- export -------------------------------------------------------------------------------------------------
    def trace_events(self) -> list[dict[str, Any]]:
        """The trace-event list: metadata (``M``), complete spans (``X``, µs) and flush instants (``i``)."""
        events: list[dict[str, Any]] = [
            _meta("process_name", CONTROLLER_PID, 0, {"name": "controller"}),
            _meta("thread_name", CONTROLLER_PID, 0, {"name": "flush"}),
        ]
        tids: dict[str, int] = {"compute": 0, "comm": 1}
        for dev in sorted({s.device for s in self.spans}):
            events.append(_meta("process_name", dev, 0, {"name": f"worker {dev}"}))
            events.append(_meta("process_sort_index", dev, 0, {"sort_index": dev}))
            for stream in sorted({s.stream for s in self.spans if s.device == dev}):
                tid = tids.setdefault(stream, len(tids))
                events.append(_meta("thread_name", dev, tid, {"name": stream}))
        for s in self.spans:
            events.append(
                {
                    "name": s.name,
                    "cat": s.category,
                    "ph": "X",
                    "ts": round(s.start * 1e6, 3),
                    "dur": round(max(s.duration, 0.0) * 1e6, 3),
                    "pid": s.device,
                    "tid": tids.setdefault(s.stream, len(tids)),
                    "args": s.args,
                }
            )
        for t, n in self.flushes:
            events.append(
                {
                    "name": "flush",
                    "cat": "controller",
                    "ph": "i",
                    "s": "g",
                    "ts": round(t * 1e6, 3),
                    "pid": CONTROLLER_PID,
                    "tid": 0,
                    "args": {"instructions": n},
                }  # fmt: skip
            )
        return events

    def export_chrome_trace(self, path: str | Path) -> Path:
        """Write ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump({"traceEvents": self.trace_events(), "displayTimeUnit": "ms"}, f)
        log.info("dtorch.profile: wrote %d spans to %s", len(self.spans), path)
        return path

    def save_gantt(self, path: str | Path, *, title: str = "dtorch timeline") -> Path:
        """A Gantt chart (one row per worker and stream) as a PNG; needs matplotlib."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = sorted({(s.device, s.stream) for s in self.spans})
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.2), dpi=80)
        colors = {"kernel": "tab:blue", "collective": "tab:orange"}
        t0 = min((s.start for s in self.spans), default=0.0)  # the chart starts at the first span
        for y, (dev, stream) in enumerate(rows):
            spans = [s for s in self.spans if s.device == dev and s.stream == stream]
            for cat, color in colors.items():
                bars = [((s.start - t0) * 1e3, s.duration * 1e3) for s in spans if s.category == cat]
                if bars:
                    ax.broken_barh(bars, (y - 0.35, 0.7), facecolors=color, edgecolor="black", linewidth=0.3)
        for t, _ in self.flushes:
            if t >= t0:
                ax.axvline((t - t0) * 1e3, color="gray", linewidth=0.4, linestyle=":")
        ax.set_yticks(range(len(rows)), [f"worker {d} {s}" for d, s in rows])
        ax.invert_yaxis()
        ax.set_xlabel("time since the first span (ms); dotted: controller flushes")
        ax.set_title(title)
        handles = [matplotlib.patches.Patch(color=c, label=k) for k, c in colors.items()]
        ax.legend(handles=handles, loc="upper right", fontsize="small")
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        plt.close(fig)
        return path

    def __enter__(self) -> Profile:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def profile(path: str | Path | None = None) -> Profile:
    """``with dt.profile("trace.json") as prof:`` — record a timeline of the block (written to ``path`` at exit,
    if given; :meth:`Profile.export_chrome_trace` / :meth:`Profile.save_gantt` any time after)."""
    return Profile(path)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}
