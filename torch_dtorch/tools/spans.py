"""Per-process span recording for :mod:`torch_dtorch.tools.trace`: :class:`SpanRecorder` installs a hook at the
front of ``runtime.kernel.before_hooks`` and one at the end of ``after_hooks`` and turns every operator a worker
runs into a :class:`Span` (host clock; CUDA events on the operator's stream when the worker's device is CUDA).

The controller uses one in thread mode (the workers are its threads); in process mode every worker process runs its
own, started and stopped by a ``ProfileControl`` instruction (:mod:`torch_dtorch.tools.remote_profile`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch_dtorch.runtime import op_runner as kernel_mod

__all__ = ["Span", "SpanRecorder", "StreamLookup", "span_from_dict", "span_to_dict"]

#: ``(device, stream kind) -> torch.cuda.Stream | None``: the CUDA stream an operator of ``device`` runs on
StreamLookup = Callable[[int, str], Any]


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


def span_to_dict(span: Span) -> dict[str, Any]:
    return asdict(span)


def span_from_dict(raw: dict[str, Any], *, shift: float = 0.0) -> Span:
    """Inverse of :func:`span_to_dict`; ``shift`` seconds are subtracted from both ends (a clock offset)."""
    return Span(
        str(raw["name"]),
        str(raw["category"]),
        int(raw["device"]),
        str(raw["stream"]),
        float(raw["start"]) - shift,
        float(raw["end"]) - shift,
        dict(raw.get("args") or {}),
    )


class SpanRecorder:
    """Records the operators run in this process between :meth:`install` and :meth:`uninstall`.

    Args:
        t0: the reference ``time.perf_counter()`` value: span times are seconds since it.
        streams: the CUDA stream lookup (``None``: host timing only).
        device: record only this device's operators (``None``: every device of this process).
    """

    def __init__(self, t0: float, streams: StreamLookup | None = None, *, device: int | None = None) -> None:
        self.t0 = t0
        self.spans: list[Span] = []
        self._streams = streams
        self._device = device
        self._open: dict[tuple[int, int], tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self._cuda: list[tuple[Any, Any, Span]] = []  # (start event, end event, host-timed span)
        self._cuda_ref: dict[int, tuple[Any, float]] = {}

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def install(self) -> None:
        kernel_mod.before_hooks.insert(0, self.before)
        kernel_mod.after_hooks.append(self.after)

    def uninstall(self) -> None:
        for hooks, fn in ((kernel_mod.before_hooks, self.before), (kernel_mod.after_hooks, self.after)):
            if fn in hooks:
                hooks.remove(fn)

    # --- hooks (worker threads) ---------------------------------------------------------------------------------
    def before(self, instr: Any, device: int) -> None:
        if self._device is not None and device != self._device:
            return
        now = time.perf_counter()
        ev = self._cuda_event(instr, device)
        self._open[(device, id(instr))] = (now, ev)

    def after(self, instr: Any, device: int) -> None:
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
            name, "collective" if collective else "kernel", device, stream, started[0] - self.t0, now - self.t0,
            args,
        )  # fmt: skip
        with self._lock:
            self.spans.append(span)
            if started[1] is not None:
                end = self._record_event(device, stream)
                self._cuda.append((started[1], end, span))

    # --- CUDA ---------------------------------------------------------------------------------------------------
    def _record_event(self, device: int, kind: str) -> Any:
        import torch

        s = self._streams(device, kind) if self._streams is not None else None
        if s is None:
            return None
        if device not in self._cuda_ref:
            ref = torch.cuda.Event(enable_timing=True)
            ref.record(s)
            ref.synchronize()
            self._cuda_ref[device] = (ref, time.perf_counter() - self.t0)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(s)
        return ev

    def _cuda_event(self, instr: Any, device: int) -> Any:
        if self._streams is None:
            return None
        node = getattr(instr, "node", None)
        assign = getattr(node, "assign", None)
        kind = assign.stream if assign is not None else "compute"
        return self._record_event(device, kind)

    def resolve_cuda(self) -> None:
        """Wait for the recorded CUDA events and replace each host-timed span by its device-timed one
        (``args["timer"] == "cuda"``), on the host clock through one reference event per device."""
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
        self._cuda.clear()
