"""CUDA stream ordering for the in-memory group (virtual ranks on one GPU, each on its own streams).

A rank's input may still be being written on the rank's current stream when another thread (the rank that
computes the collective) reads it, and a result computed on that thread's stream is then used on the receiving
rank's stream. So: every rank records an event on its current stream when it arrives, the computing thread makes
its stream wait for all of them, records a *done* event after computing, and every rank makes its current stream
wait for it and marks its result as used there (``record_stream``, so the caching allocator does not hand the memory
out again too early). Nothing here runs for CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Events", "adopt", "record_arrival", "record_done", "wait_arrivals"]

Events = dict[torch.device, Any]


def record_arrival(payload: object) -> Any | None:
    """An event on the current stream of ``payload``'s device if it is a CUDA tensor, else ``None``."""
    if isinstance(payload, torch.Tensor) and payload.is_cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(payload.device))
        return event
    return None


def wait_arrivals(events: Iterable[Any | None], device: torch.device | None) -> None:
    """Make this thread's current stream on ``device`` wait for every arrival event."""
    if device is None or device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    for event in events:
        if event is not None:
            stream.wait_event(event)


def record_done(results: Iterable[torch.Tensor | None]) -> Events | None:
    """One event per CUDA device of ``results``, recorded on this thread's current stream there."""
    events: Events = {}
    for t in results:
        if t is not None and t.is_cuda and t.device not in events:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(t.device))
            events[t.device] = event
    return events or None


def adopt(t: torch.Tensor, done: Events | None) -> torch.Tensor:
    """Make this thread's current stream wait until ``t`` is computed, and tell the allocator it is used there."""
    if done is not None and t.is_cuda:
        stream = torch.cuda.current_stream(t.device)
        event = done.get(t.device)
        if event is not None:
            stream.wait_event(event)
        t.record_stream(stream)
    return t
