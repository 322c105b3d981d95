"""The controller's receiving side of a :class:`~torch_dtorch.cluster.runner.ClusterRunner`: :class:`Replies`.

One receiver thread (:meth:`Replies.loop`) takes every worker reply from the PULL socket — fetched values and
barrier markers (``VALUE``, delivered to the runner's store; a value that ends a batch acknowledges it), ``ACK``
(ready, a batch run: cumulative, or a CUDA IPC upload copied), ``ERROR`` (messages a worker dropped, fatal errors)
— and serves late ``JOIN`` requests on the control socket (refused and reported). Each worker's free-memory figure
rides on its replies (``mem_free``, for :mod:`torch_dtorch.cluster.pools`). Start-up hands messages to
:meth:`Replies.handle` the same way before the thread starts.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
import zmq

from torch_dtorch.cluster.ipc import CudaIpcError, ack_body, is_ipc_body, open_copy, parse_ack
from torch_dtorch.cluster.joins import Member
from torch_dtorch.cluster.protocol import WorkerFailedError
from torch_dtorch.cluster.store import key_from_wire, value_from_body
from torch_dtorch.cluster.transport import MessageKind, TransportError
from torch_dtorch.collectives.errors import TensorStoreError

if TYPE_CHECKING:
    from torch_dtorch.cluster.runner import ClusterRunner

__all__ = ["Replies"]

log = logging.getLogger("torch_dtorch.cluster.runner")

_JOIN_POLL_S = 0.05  # after start-up, the receiver thread answers late JOINs this often


class Replies:
    """What the controller does with each worker reply (see the module docstring)."""

    def __init__(self, runner: ClusterRunner) -> None:
        self.runner = runner

    def loop(self) -> None:
        r = self.runner
        pull, desk = r.net.pull, r.net.desk
        assert pull is not None and desk is not None
        next_joins = 0.0
        while not r._closed:
            now = time.monotonic()
            if now >= next_joins:  # late JOINs: refused and reported (the socket is shared with uploads)
                next_joins = now + _JOIN_POLL_S
                with r._lock:
                    if r._closed:
                        return
                    try:
                        desk.serve(0)
                    except zmq.ZMQError:
                        return
            try:
                msg = pull.recv(_JOIN_POLL_S)
            except TransportError as e:  # a sequence gap: replies were lost
                if not r._closed:
                    r._on_failure(WorkerFailedError(f"ClusterRunner: lost worker replies: {e}"))
                return
            except zmq.ZMQError:
                return
            if msg is not None:
                self.handle(msg)

    def handle(self, msg: Any) -> None:
        r = self.runner
        m = r._by_id.get(msg.sender)
        if m is None:
            r._on_reject(TransportError(f"reply from unknown sender {msg.sender!r} dropped"))
            return
        body = msg.body if isinstance(msg.body, dict) else {}
        mem_free = body.get("mem_free")
        if type(mem_free) is int and mem_free >= 0:  # the memory pre-check's figure of its device
            m.mem_free = mem_free
            m.mem_reports += 1
        if msg.kind == MessageKind.VALUE:
            try:
                if m.local and is_ipc_body(body):
                    kv = self._ipc_value(m, body)
                else:
                    shm = r.net.shm if m.local else None
                    kv = value_from_body(body, device=m.device, shm=shm, direction="f")
            except Exception as e:  # noqa: BLE001
                r._on_reject(TransportError(f"bad VALUE from {m.worker_id}: {e}"))
                return
            if kv is not None:
                r.store.deliver(*kv)
            if isinstance(
                body.get("ack"), int
            ):  # the batch that ended with this reply is done (and all before)
                self._acked(m, body["ack"])
        elif msg.kind == MessageKind.ACK:
            if body.get("ready"):
                m.ready = True
                if isinstance(body.get("cuda_index"), int):
                    m.cuda_index = body["cuda_index"]
            elif "ipc_done" in body:
                self._ipc_acknowledged(m, body)
            elif isinstance(body.get("ack"), int):  # cumulative: every batch up to this one ran
                self._acked(m, body["ack"])
        elif msg.kind == MessageKind.ERROR:
            if "rejected" in body:
                n = body.get("count", 1)
                r._on_reject(
                    TransportError(f"worker {m.worker_id} dropped a message: {body['rejected']}"),
                    count=n if type(n) is int and 0 < n < 1 << 62 else 1,
                )
            else:
                err = WorkerFailedError(
                    f"worker {m.worker_id} on host {m.host!r} failed and left the cluster: {body.get('fatal', body)}"
                )
                r._on_failure(err)

    def _acked(self, m: Member, seq: int) -> None:
        """``m`` ran every batch up to ``seq``: wake ``wait_idle`` and let the outbox publish what it held."""
        r = self.runner
        with r._acks:
            m.acked = max(m.acked, seq)
            r._acks.notify_all()
        r.released()

    def _ipc_value(self, m: Member, body: dict[str, Any]) -> tuple[Any, torch.Tensor] | None:
        """A fetched value ``m`` shared through CUDA IPC: copied here, then acknowledged (``None``: could not
        open it; ``m`` resends it through host memory)."""
        r = self.runner
        key = key_from_wire(body.get("key"))
        try:
            value = open_copy(body["cuda_ipc"])  # a tensor of this process, on the worker's GPU
        except CudaIpcError as e:
            log.warning("ClusterRunner: %s; CUDA IPC off for %s (host memory instead)", e, m.worker_id)
            m.cuda_ipc = False
            r.cuda_ipc_counts["fallback"] += 1
            r._send_control(m, ack_body(key, error=e), kind=MessageKind.ACK)
            return None
        r.cuda_ipc_counts["received"] += 1
        r._send_control(m, ack_body(key), kind=MessageKind.ACK)
        return key, value

    def _ipc_acknowledged(self, m: Member, body: dict[str, Any]) -> None:
        """``m`` copied an upload shared through CUDA IPC (drop it) or could not open it (resend it)."""
        r = self.runner
        try:
            ack = parse_ack(body)
        except TensorStoreError as e:
            r._on_reject(TransportError(f"bad ACK from {m.worker_id}: {e}"))
            return
        held = r._ipc.release(ack)
        if ack.ok or held is None:
            return
        log.warning(
            "ClusterRunner: %s could not open %r (%s); resending it through host memory",
            m.worker_id,
            ack.key,
            ack.error,
        )
        m.cuda_ipc = False
        r.cuda_ipc_counts["fallback"] += 1
        try:
            torch.cuda.synchronize(held.device)  # its copy ran on the uploading thread's stream
            r._send_value(m.device, ack.key, held)
        except Exception as e:  # noqa: BLE001 - the cluster failed meanwhile: the upload's reader gets that
            log.debug("ClusterRunner: resend of %r failed: %s", ack.key, e)
