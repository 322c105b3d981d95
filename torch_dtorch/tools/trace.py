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

In process mode each worker process records its own spans the same way (:mod:`torch_dtorch.tools.remote_profile`:
a ``ProfileControl`` instruction starts and stops them; the spans come back through the store at the end of the
block, within ``timeout_s``). Workers on the controller's host share its clock (``CLOCK_MONOTONIC``); a worker on
another host is aligned by an estimate from the stop round trip (``Profile.workers``: pid, host, offset, error).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch_dtorch.tools import remote_profile
from torch_dtorch.tools.remote_profile import WorkerClock
from torch_dtorch.tools.spans import Span, SpanRecorder, StreamLookup

__all__ = ["Profile", "Span", "WorkerClock", "profile"]

log = logging.getLogger(__name__)

CONTROLLER_PID = -1


class Profile:
    """What one :func:`profile` block recorded (``spans``, ``flushes``); export with :meth:`export_chrome_trace`.

    ``timeout_s`` bounds the wait for the worker processes' timelines at the end (process mode)."""

    def __init__(self, path: str | Path | None = None, *, timeout_s: float = 30.0) -> None:
        self.path = Path(path) if path is not None else None
        self.timeout_s = timeout_s
        self.spans: list[Span] = []
        #: (seconds since start, number of instructions in the batch)
        self.flushes: list[tuple[float, int]] = []
        #: process mode: who recorded each worker's spans (os pid, host) and how its clock was aligned
        self.workers: dict[int, WorkerClock] = {}
        #: seconds from the start to the end of the block (its work finished), set by :meth:`stop`
        self.elapsed = 0.0
        self._t0 = 0.0
        self._runner: Any = None
        self._submit: Callable[..., Any] | None = None
        self._rec = SpanRecorder(0.0)
        self._remote: int | None = None  # process mode: the id of the workers' profile

    @property
    def _before(self) -> Callable[[Any, int], None]:
        return self._rec.before

    @property
    def _after(self) -> Callable[[Any, int], None]:
        return self._rec.after

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        from torch_dtorch.device.state import session_or_none

        self._t0 = time.perf_counter()
        rt = session_or_none()
        runner: Any = rt.executor.runner if rt is not None else None
        self._rec = SpanRecorder(self._t0, _thread_streams(runner) if runner is not None else None)
        self.spans = self._rec.spans
        self._rec.install()
        if rt is None or runner is None:
            return
        self._runner, self._submit = runner, runner.submit
        original = runner.submit

        def submit(batch: Any) -> Any:
            self.flushes.append((time.perf_counter() - self._t0, len(batch)))
            return original(batch)

        runner.submit = submit  # instance attribute; removed in stop()
        if getattr(rt, "mode", "thread") != "thread":
            try:
                self._remote = remote_profile.start(rt.executor, self._t0)
            except Exception as e:  # noqa: BLE001 - profiling must not break the program
                log.warning("dtorch.profile: could not start the worker profiles (%s); no worker spans", e)

    def stop(self) -> None:
        remote: list[Span] = []
        if self._runner is not None:
            try:
                from torch_dtorch.device.state import session_or_none

                rt = session_or_none()
                if rt is not None and rt.executor.runner is self._runner:
                    if self._remote is None:
                        rt.executor.sync()  # every span issued inside the block is finished
                    else:
                        remote = self._stop_remote(rt.executor)
            finally:
                if "submit" in vars(self._runner):
                    del self._runner.submit
        if not self.elapsed:
            self.elapsed = time.perf_counter() - self._t0
        self._rec.uninstall()
        self._rec.resolve_cuda()
        self.spans.extend(remote)
        self.spans.sort(key=lambda s: (s.start, s.device))
        if self.path is not None:
            self.export_chrome_trace(self.path)

    def _stop_remote(self, executor: Any) -> list[Span]:
        """Process mode: a bounded barrier (the block's work is done), then the workers' spans."""
        assert self._remote is not None
        t_start = time.perf_counter()
        try:
            executor.sync(timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a dead or hung worker: keep what arrives
            log.warning("dtorch.profile: the workers did not finish the block (%s: %s)", type(e).__name__, e)
        self.elapsed = time.perf_counter() - self._t0
        left = max(self.timeout_s - (time.perf_counter() - t_start), 1.0)
        spans, self.workers = remote_profile.collect(executor, self._remote, timeout_s=left)
        self._remote = None
        return spans

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
            w = self.workers.get(dev)
            if w is not None:  # process mode: the worker process and its clock alignment
                clock = (
                    "shared clock"
                    if w.shared_clock
                    else f"clock offset {w.offset * 1e3:+.3f} ms ± {w.error * 1e3:.3f}"
                )
                events.append(
                    _meta("process_labels", dev, 0, {"labels": f"pid {w.pid} on {w.host}, {clock}"})
                )
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


def profile(path: str | Path | None = None, *, timeout_s: float = 30.0) -> Profile:
    """``with dt.profile("trace.json") as prof:`` — record a timeline of the block (written to ``path`` at exit,
    if given; :meth:`Profile.export_chrome_trace` / :meth:`Profile.save_gantt` any time after). ``timeout_s``:
    process mode, the longest wait for the workers' timelines at exit (a dead worker's are missing, with a
    warning)."""
    return Profile(path, timeout_s=timeout_s)


def _thread_streams(runner: Any) -> StreamLookup | None:
    """Thread mode on CUDA: the stream of each worker's operators (the runner's :class:`KernelStream` per device)."""
    streams = getattr(runner, "streams", None)
    if not isinstance(streams, dict):
        return None

    def lookup(device: int, kind: str) -> Any:
        ks = streams.get(device)
        if ks is None or not ks.is_cuda:
            return None
        return ks.stream(kind)

    return lookup


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": args}
