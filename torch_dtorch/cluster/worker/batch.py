"""One batch on a worker process's kernel thread (:class:`BatchRun`), the heartbeat that names the op in flight
(:class:`OpHeartbeat`) and the reply socket its threads share (:class:`LockedPusher`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from torch_dtorch.cluster.codec.hits import HitRun
from torch_dtorch.cluster.heartbeat import HeartbeatClient
from torch_dtorch.cluster.transport import MessageKind, Pusher

if TYPE_CHECKING:
    from torch_dtorch.cluster.worker.process import WorkerProcess

__all__ = ["BatchRun", "LockedPusher", "OpHeartbeat", "op_name"]


class LockedPusher(Pusher):
    """The reply socket, shared by the main, data and kernel threads (sends serialized by a lock)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()

    def send(self, obj: Any, *, kind: MessageKind) -> int:
        with self._lock:
            return super().send(obj, kind=kind)

    def close_after_flush(self, linger_ms: int = 1000) -> None:
        with self._lock:
            if not self.closed:
                self._sock.setsockopt(zmq.LINGER, linger_ms)
                self._sock.close()


class OpHeartbeat(HeartbeatClient):
    """Heartbeat that records the op in flight without sending a beat per op (the periodic beat carries it)."""

    def note_op(self, op: str) -> None:
        with self._lock:
            self._busy_op, self._last_op, self._busy_since = op, op, time.time()

    def note_idle(self) -> None:
        with self._lock:
            self._busy_op = None


def op_name(instr: Any) -> str:
    node = getattr(instr, "node", None)
    if node is not None:
        outs = getattr(node, "outputs", ())
        return f"{node.name} -> %{outs[0].id}" if outs else str(node.name)
    if type(instr) is HitRun:
        return instr.name
    return type(instr).__name__


class BatchRun:
    """One batch on the kernel thread: run every instruction, then note the batch as done. When the last instruction
    sends a value (a barrier marker, a fetch: what a waiting caller needs), the acknowledgement rides on that value
    message. Otherwise it is *cumulative*: the process acknowledges the latest batch it ran once no further batch is
    waiting (:meth:`WorkerProcess.ack_if_idle`), so a stream of batches costs one ACK, not one per batch."""

    __slots__ = ("proc", "seq", "batch")

    def __init__(self, proc: WorkerProcess, seq: int, batch: Sequence[Any]) -> None:
        self.proc, self.seq, self.batch = proc, seq, batch

    def __call__(self) -> None:
        proc = self.proc
        note = proc.hb.note_op
        batch = self.batch
        last = len(batch) - 1
        seq = self.seq

        def before(i: int, instr: Any) -> None:
            note(op_name(instr))
            if i == last:
                proc.ack_with_value = seq  # taken by _send_value if this instruction replies

        try:
            proc.worker.run_batch(batch, before=before)
        finally:
            proc.hb.note_idle()
        if proc.ack_with_value is None and batch:
            proc.unacked = None  # the last instruction's reply acknowledged it (and every batch before)
            return
        proc.ack_with_value = None
        proc.unacked = seq
