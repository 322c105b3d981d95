"""``dt.profile`` in process mode: the worker processes record their own spans.

The controller queues a :class:`ProfileControl` ``start`` instruction (with its reference ``time.perf_counter()``)
in issue order; each worker process's handler installs a :class:`~torch_dtorch.tools.spans.SpanRecorder` (the
same hooks and CUDA event timing as thread mode). At the end a ``stop`` instruction uninstalls it, resolves the
CUDA events and puts the spans, as JSON bytes in a ``uint8`` tensor, in the worker's store under
``(key, device)``; the controller takes them out of its store like fetched values (:func:`collect`), with a bounded
wait: a worker that died or hangs costs at most ``timeout_s`` and a warning, and the spans that did arrive are kept.

Clocks: ``time.perf_counter()`` is ``CLOCK_MONOTONIC`` on Linux, shared by every process of one host, so a worker on
the controller's host measures its spans against the controller's reference directly. A worker on another host
(its reported host name differs) has an unknown offset: it is estimated from the ``stop`` round trip (NTP-style,
after a barrier so nothing is queued in front of it) and subtracted; :attr:`WorkerClock.error` bounds it (half
the round trip minus the worker's own handling time).

Worker processes import this module at start through ``torch_dtorch/__init__`` (``tools`` -> ``trace``), so its
codec and handler are registered before the first batch is decoded.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from torch_dtorch.cluster.codec.common import CodecError, register_codec
from torch_dtorch.collectives.errors import TensorStoreTimeout
from torch_dtorch.executor.worker import Worker, register_instruction
from torch_dtorch.runtime.blob import KernelError
from torch_dtorch.tools.spans import Span, SpanRecorder, span_from_dict, span_to_dict

__all__ = ["ProfileControl", "WorkerClock", "collect", "start"]

log = logging.getLogger(__name__)

_IDS = itertools.count(1)
#: the recorders of the profiles running in this (worker) process: ``worker -> {profile id: recorder}``
_ACTIVE: weakref.WeakKeyDictionary[Worker, dict[int, SpanRecorder]] = weakref.WeakKeyDictionary()
_POLL_S = 0.002


@dataclass(frozen=True, slots=True)
class ProfileControl:
    """Start (``action="start"``, ``t0``: the controller's reference clock) or stop (``action="stop"``: reply with
    the spans under ``(key, device)``) profile ``profile_id`` on every worker."""

    action: str
    profile_id: int
    t0: float = 0.0
    key: int | None = None


@dataclass(frozen=True)
class WorkerClock:
    """Who recorded a worker's spans and how its clock was aligned: ``offset`` (seconds, subtracted from its
    spans; 0 on the controller's host), ``error`` (its bound; 0 when the clock is shared)."""

    device: int
    pid: int
    host: str
    offset: float = 0.0
    error: float = 0.0
    shared_clock: bool = True


# --- worker side ----------------------------------------------------------------------------------------------------


def _streams_of(worker: Worker) -> Any:
    ks = worker.stream
    if ks is None or not ks.is_cuda:
        return None
    return lambda device, kind: ks.stream(kind) if device == worker.device else None


@register_instruction(ProfileControl)
def _control(worker: Worker, instr: ProfileControl) -> None:
    received = time.perf_counter()
    table = _ACTIVE.setdefault(worker, {})
    if instr.action == "start":
        old = table.pop(instr.profile_id, None)
        if old is not None:
            old.uninstall()
        rec = SpanRecorder(instr.t0, _streams_of(worker), device=worker.device)
        table[instr.profile_id] = rec
        rec.install()
        return
    if instr.action != "stop" or instr.key is None:
        log.error("worker %d: malformed %r", worker.device, instr)
        return
    reply: Any
    try:
        done = table.pop(instr.profile_id, None)
        spans: list[dict[str, Any]] = []
        if done is not None:
            done.uninstall()
            done.resolve_cuda()
            spans = [span_to_dict(s) for s in done.spans]
        body = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "received": received,
            "sent": time.perf_counter(),
            "started": done is not None,
            "spans": spans,
        }
        reply = torch.frombuffer(bytearray(json.dumps(body, default=str).encode()), dtype=torch.uint8)
    except Exception as e:  # noqa: BLE001 - the controller gets the error instead of the spans
        reply = KernelError("profile", worker.device, e, detail="while shipping the timeline")
    try:
        worker.store.put((instr.key, worker.device), reply)
    except Exception:  # noqa: BLE001 - handlers must not raise; the controller's wait is bounded
        log.exception("worker %d: could not send its timeline", worker.device)


# --- controller side ------------------------------------------------------------------------------------------------


def start(executor: Any, t0: float) -> int:
    """Queue ``start`` on every worker (in issue order: it does not wait); the new profile's id."""
    pid = next(_IDS)
    executor.append_instruction(ProfileControl("start", pid, t0=t0))
    executor.flush()
    return pid


def collect(executor: Any, profile_id: int, *, timeout_s: float) -> tuple[list[Span], dict[int, WorkerClock]]:
    """Queue ``stop`` and take every worker's spans out of the controller's store (on the controller's timeline).
    Waits at most ``timeout_s`` in all: a worker that does not answer (dead, hung) is logged and skipped."""
    runner = executor.runner
    store = runner.store
    devices = list(runner.devices)
    key = next(executor._keys)  # the executor's request ids: never collides with a fetch or a barrier
    sent = time.perf_counter()
    try:
        executor.append_instruction(ProfileControl("stop", profile_id, key=key))
        executor.flush()
    except Exception as e:  # noqa: BLE001 - e.g. a worker died: the cluster refuses new batches
        log.warning(
            "dtorch.profile: could not stop the worker profiles (%s: %s); no worker spans",
            type(e).__name__,
            e,
        )
        return [], {}
    replies: dict[int, tuple[Any, float]] = {}
    pending = list(devices)
    deadline = sent + timeout_s
    failure: BaseException | None = None
    while pending and failure is None and time.perf_counter() < deadline:
        for d in list(pending):
            try:
                value = store.pop((key, d), _POLL_S)
            except (
                TensorStoreTimeout
            ):  # not yet (a WorkerHangError is a TimeoutError too: the cluster failed)
                continue
            except Exception as e:  # noqa: BLE001 - the cluster failed (e.g. WorkerLostError)
                failure = e
                break
            replies[d] = (value, time.perf_counter())
            pending.remove(d)
    if pending:
        why = (
            f"{type(failure).__name__}: {failure}"
            if failure is not None
            else f"no answer within {timeout_s:g} s"
        )
        log.warning(
            "dtorch.profile: no timeline from worker(s) %s (%s); keeping the spans that arrived", pending, why
        )
        if failure is None:
            _drop_late_replies(store, [(key, d) for d in pending])
    spans: list[Span] = []
    clocks: dict[int, WorkerClock] = {}
    here = _local_host()
    for d, (value, received) in sorted(replies.items()):
        if isinstance(value, BaseException):
            log.warning("dtorch.profile: worker %d could not ship its timeline: %s", d, value)
            continue
        try:
            body = json.loads(bytes(value.numpy().tobytes()).decode())
            clock = _clock(d, body, sent, received, here)
            spans.extend(span_from_dict(s, shift=clock.offset) for s in body["spans"])
        except Exception as e:  # noqa: BLE001 - one unreadable reply must not lose the others
            log.warning("dtorch.profile: unreadable timeline from worker %d: %s", d, e)
            continue
        clocks[d] = clock
        if not body.get("started", True):
            log.warning("dtorch.profile: worker %d never received the start of this profile", d)
    return spans, clocks


#: how long a late timeline (a worker that was only slow) is waited for in the background, to be dropped
LATE_REPLY_GRACE_S = 120.0


def _drop_late_replies(store: Any, keys: list[Any]) -> None:
    """Take the replies that may still arrive for ``keys`` out of the store, in a daemon thread, so a slow worker's
    timeline does not stay there for the rest of the run (each key is waited for at most
    :data:`LATE_REPLY_GRACE_S`)."""

    def drain() -> None:
        deadline = time.monotonic() + LATE_REPLY_GRACE_S
        for k in keys:
            try:
                store.pop(k, max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001, S112 - never came (dead worker, closed store): nothing to drop
                continue

    threading.Thread(target=drain, name="dtorch-profile-late-replies", daemon=True).start()


def _local_host() -> str:
    """This host's name, compared with each worker's to tell whether they share ``CLOCK_MONOTONIC``."""
    return socket.gethostname()


def _clock(device: int, body: dict[str, Any], sent: float, received: float, here: str) -> WorkerClock:
    pid, host = int(body["pid"]), str(body["host"])
    if host == here:  # CLOCK_MONOTONIC is shared by the processes of one host
        return WorkerClock(device, pid, host)
    w_in, w_out = float(body["received"]), float(body["sent"])
    offset = ((w_in - sent) + (w_out - received)) / 2
    error = max((received - sent) - (w_out - w_in), 0.0) / 2
    return WorkerClock(device, pid, host, offset, error, shared_clock=False)


# --- process mode: the instruction codec ----------------------------------------------------------------------------


def _register_codec() -> None:
    def enc(instr: ProfileControl, ctx: Any) -> Any:
        return [instr.action, instr.profile_id, instr.t0, instr.key]

    def dec(tree: Any, ctx: Any) -> ProfileControl:
        try:
            action, pid, t0, key = tree
            return ProfileControl(str(action), int(pid), float(t0), None if key is None else int(key))
        except (TypeError, ValueError) as e:
            raise CodecError(f"malformed ProfileControl {tree!r:.80}: {e}") from None

    register_codec(ProfileControl, tag="tools.profile", encode=enc, decode=dec)


_register_codec()
