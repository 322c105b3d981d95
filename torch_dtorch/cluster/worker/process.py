"""The worker process of cluster mode (:class:`WorkerProcess`); its command line is in :mod:`.cli`.

Start-up: read the cluster secret (``--secret-fd``, an inherited pipe, for local workers; ``--secret-file`` for
remote ones), send a signed ``JOIN`` to the controller's control endpoint and wait for its ``WELCOME`` (endpoints and
settings), start the heartbeat, connect the batch subscriber and the reply pusher, answer the handshake, build the
``torch.distributed`` communicator (Gloo on CPU, NCCL on CUDA) through the controller's ``TCPStore``, and report
ready. Then:

- the kernel thread receives ordered batches (sequence numbers checked), decodes them and runs them in order with
  the same :class:`~torch_dtorch.executor.worker.Worker` as thread mode (no thread hand-off per batch); the main
  thread waits for the end;
- a data thread receives this worker's uploads on the control socket;
- the heartbeat threads beat whatever the kernel thread does (a long kernel never looks like death; it only trips
  the controller's hang timeout).

The process exits on ``SHUTDOWN`` (it says goodbye on the heartbeat at once, so the controller's closing streams are
not taken for its death: exit code 0), when the controller goes away (heartbeat), or on a fatal protocol error
(reported to the controller first). Exit codes: 0 ok, 1 error, 2 usage, 3 controller lost.

Tensors of at least ``shm_threshold`` bytes travel through the controller's shared-memory store when the
``WELCOME`` names one (local workers only): the signed message then carries the key, the bytes go through a file in
a private (0700) directory under ``/dev/shm``; CUDA tensors of that size travel as CUDA IPC handles when the
``WELCOME`` says ``cuda_ipc`` (:mod:`torch_dtorch.cluster.ipc`: this process copies uploads onto its GPU, and holds the fetched
values it shares until the controller acknowledged its copy).
"""

from __future__ import annotations

import importlib
import logging
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq

from torch_dtorch.cluster.codec import BatchDecoder
from torch_dtorch.cluster.heartbeat.client import exit_on_controller_lost
from torch_dtorch.cluster.ipc import CudaFetchWorker, WorkerIpc, is_ipc_body
from torch_dtorch.cluster.protocol import DEFAULT_START_TIMEOUT_S, EXIT_ERROR, EXIT_OK
from torch_dtorch.cluster.store import StorePoisonBoard, WorkerStore, value_body, value_from_body
from torch_dtorch.cluster.transport import MessageKind, Subscriber, TransportError
from torch_dtorch.cluster.transport.errors import SequenceError
from torch_dtorch.cluster.transport.rejects import RejectLog
from torch_dtorch.cluster.transport.tempdirs import remove_if_orphaned, remove_store_if_orphaned
from torch_dtorch.cluster.transport.wire import decode, encode
from torch_dtorch.cluster.worker.batch import BatchRun, LockedPusher, OpHeartbeat
from torch_dtorch.cluster.worker.profile import kernel_thread_profile
from torch_dtorch.collectives.shm_store import ShmTensorStore
from torch_dtorch.collectives.torchdist import TorchDistComm
from torch_dtorch.config import get_config
from torch_dtorch.executor.memory_check import cuda_free_bytes, host_available_bytes
from torch_dtorch.executor.worker import Worker
from torch_dtorch.runtime.stream import KernelStream

__all__ = ["WorkerProcess"]

log = logging.getLogger("torch_dtorch.worker")

_POLL_S = 0.2
_REJECT_REPORT_S = 1.0
_ORPHAN_WAIT_S = 1.0  # how long a worker whose controller is lost waits for its process to be gone (clean-up)


class WorkerProcess:
    """One worker process (see the module docstring)."""

    def __init__(
        self,
        *,
        controller: str,
        device: int,
        secret: bytes,
        host: str | None = None,
        local_index: int | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ) -> None:
        self.controller = controller
        self.device = device
        self.secret = secret
        self.host = host
        self.local_index = local_index
        self.start_timeout_s = start_timeout_s
        self.worker_id = f"w{device}"
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.control: zmq.Socket[bytes] | None = None
        self.stop = threading.Event()
        self.exit_code = EXIT_OK
        self.welcome: dict[str, Any] = {}
        self.shm: Any = None  # ShmTensorStore attached to the controller's directory (local workers)
        self.shm_threshold = 0
        self.ipc: Any = None  # WorkerIpc when CUDA tensors travel as CUDA IPC handles (local CUDA workers)
        #: on the kernel thread: the batch whose last instruction runs now (acknowledged with its reply)
        self.ack_with_value: int | None = None
        #: on the kernel thread: the latest batch run but not acknowledged yet (see :meth:`ack_if_idle`)
        self.unacked: int | None = None
        #: messages this worker dropped (count, latest texts; reported to the controller rate-limited)
        self.rejects = RejectLog(log, f"worker {self.worker_id}", interval_s=_REJECT_REPORT_S)

    # --- start-up -----------------------------------------------------------------------------------------------
    def join(self) -> dict[str, Any]:
        """Send ``JOIN`` on the control socket and return the controller's ``WELCOME`` body."""
        sock = self.ctx.socket(zmq.DEALER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM):
            sock.setsockopt(opt, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._from_host(self.controller))
        self.control = sock
        nonce = secrets.token_hex(16)
        body = {
            "device": self.device,
            "nonce": nonce,
            "pid": os.getpid(),
            "host": self.host or socket.gethostname(),
        }
        frames = encode(body, kind=MessageKind.JOIN, seq=1, sender=self.worker_id, secret=self.secret)
        sock.send_multipart(frames, copy=False)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(round(left * 1000), zmq.POLLIN):
                raise TimeoutError(
                    f"worker {self.worker_id}: no WELCOME from the controller at {self.controller} within "
                    f"{self.start_timeout_s:g} s. Check the address, that the controller waits for device "
                    f"{self.device}, and that both use the same cluster secret (a JOIN with a wrong secret is "
                    "dropped by the controller)."
                )
            try:
                msg = decode(sock.recv_multipart(copy=False), secret=self.secret)
            except TransportError as e:
                log.warning("worker %s: dropped a control message: %s", self.worker_id, e)
                continue
            if (
                msg.kind == MessageKind.WELCOME
                and isinstance(msg.body, dict)
                and msg.body.get("nonce") == nonce
            ):
                if msg.body.get("refused"):
                    raise RuntimeError(
                        f"worker {self.worker_id}: the controller refused to join: {msg.body['refused']}"
                    )
                return msg.body
            log.warning("worker %s: ignored an unexpected %s during join", self.worker_id, msg.kind.name)

    def _from_host(self, endpoint: str) -> str:
        """``endpoint``, connected from this worker's ``--host`` address when given (ZMQ ``tcp://SRC:0;DST``)."""
        if self.host and endpoint.startswith("tcp://"):
            return f"tcp://{self.host}:0;{endpoint[len('tcp://') :]}"
        return endpoint

    def run(self) -> int:
        w = self.welcome = self.join()
        # the modules the controller declared (instructions defined above the executor, then the user's)
        for name in w.get("imports", ()):
            importlib.import_module(name)
        session = int(w["session"])
        self.pusher = LockedPusher(
            self._from_host(w["pull"]), secret=self.secret, sender=self.worker_id, session=session
        )
        self.hb = OpHeartbeat(
            w["heartbeat"],
            self.worker_id,
            host=self.host or socket.gethostname(),
            connect_timeout_s=self.start_timeout_s,
            on_controller_lost=self._controller_lost,
        )
        self.hb.start()
        self.sub = Subscriber(
            self._from_host(w["pub"]), secret=self.secret, reply=self.pusher, on_reject=self._report_reject
        )
        self.data_session = session
        self._attach_shm(w)

        self.decoder = BatchDecoder()
        self.decoder.progress = self.hb.note_op  # a hit record run on the general path names its op
        self._build_worker()
        data = threading.Thread(target=self._data_loop, name=f"dtorch-data-{self.device}", daemon=True)
        self._data_thread = data
        data.start()
        try:
            self.stream.submit(
                self._batch_loop
            )  # receive and run on the kernel thread: no hand-off per batch
            while not self.stop.wait(_POLL_S):
                pending = self.rejects.take_pending()
                if pending is not None:
                    self._forward_rejects(*pending)
        finally:
            self.stop.set()
            self._close()
        return self.exit_code

    def _controller_lost(self, reason: str) -> None:
        """The controller is gone (heartbeat): remove what it can no longer remove (its socket directories and
        shared-memory store, only once its process is gone), then exit at once."""
        try:
            wait_s = _ORPHAN_WAIT_S  # the stream breaks while a killed controller is still being torn down
            for endpoint in (self.controller, self.welcome.get("pub", ""), self.welcome.get("pull", "")):
                if remove_if_orphaned(str(endpoint), wait_s=wait_s):
                    wait_s = 0.0
            if self.shm is not None:
                remove_store_if_orphaned(self.shm.path, wait_s=wait_s)
        except Exception as e:  # noqa: BLE001 - exiting anyway
            log.warning("worker %s: cleaning up after the controller failed: %s", self.worker_id, e)
        exit_on_controller_lost(reason)

    def _attach_shm(self, w: dict[str, Any]) -> None:
        path = w.get("shm")
        if not isinstance(path, str) or not path:
            return

        try:
            self.shm = ShmTensorStore(path, timeout_s=0)
        except (OSError, ValueError) as e:  # e.g. another host after all: everything goes as ZMQ frames
            log.warning(
                "worker %s: cannot use the shared-memory store %s (%s); using ZMQ frames",
                self.worker_id,
                path,
                e,
            )
            return
        self.shm_threshold = int(w.get("shm_threshold", 1 << 20))

    def _build_worker(self) -> None:

        w = self.welcome
        cfg = get_config()
        cfg.debug = bool(w.get("debug", cfg.debug))
        device_type = str(w["device_type"])
        worker_cls: type[Worker] = Worker
        if device_type == "cuda":
            index = (
                0
                if w.get("simulate")
                else (self.local_index if self.local_index is not None else self.device)
            )
            torch_device = torch.device("cuda", index)
            torch.cuda.set_device(torch_device)
            send = lambda body, kind: self.pusher.send(body, kind=kind)
            self.ipc = WorkerIpc.from_welcome(w, device=torch_device, send=send, host_body=self._host_body)
            worker_cls = Worker if self.ipc is None else CudaFetchWorker
        else:
            torch_device = torch.device("cpu")
        timeout = float(w.get("collective_timeout_s", 300.0))
        self.tcp_store = dist.TCPStore(
            str(w["store_host"]),
            int(w["store_port"]),
            is_master=False,
            timeout=timedelta(seconds=self.start_timeout_s),
        )
        self.store = WorkerStore(self.device, self._send_value, timeout_s=timeout)
        self.stream = KernelStream(torch_device, name=f"dtorch-worker-{self.device}")
        ready = threading.Event()
        failure: list[BaseException] = []

        def build() -> None:  # on the kernel thread: the rendezvous blocks until every worker is here
            try:
                comm = TorchDistComm(
                    self.tcp_store,
                    self.device,
                    tuple(w["world"]),
                    backend=str(w.get("backend", "gloo")),
                    torch_device=torch_device if device_type == "cuda" else None,
                    timeout_s=timeout,
                    prefix=f"dtorch-{w['session']}",
                )
                self.worker = worker_cls(
                    self.device,
                    torch_device,
                    comm,
                    self.store,
                    stream=self.stream,
                    board=StorePoisonBoard(self.tcp_store),
                    validate=bool(w.get("validate", False)),
                )
            except BaseException as e:  # noqa: BLE001 - reported to the controller below
                failure.append(e)
            finally:
                ready.set()

        self.stream.submit(build)
        # answer the handshake while the rendezvous runs (the controller waits for both)
        deadline = time.monotonic() + self.start_timeout_s
        while not ready.wait(0.01):
            self._recv_one(0.05)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"worker {self.worker_id}: the collectives rendezvous did not finish within "
                    f"{self.start_timeout_s:g} s (some worker of {w['world']} never joined)"
                )
        if failure:
            raise RuntimeError(
                f"worker {self.worker_id}: building the communicator failed: {failure[0]!r}"
            ) from failure[0]
        report: dict[str, Any] = {"ready": True, "pid": os.getpid()}
        if device_type == "cuda":
            report["cuda_index"] = torch_device.index  # the controller copies CUDA IPC uploads there
        self._torch_device = torch_device
        self._report_memory = device_type == "cuda" or self.shm is None  # CUDA, or maybe another host
        self._add_mem_free(report)
        self.pusher.send(report, kind=MessageKind.ACK)

    # --- loops --------------------------------------------------------------------------------------------------
    def _batch_loop(self) -> None:
        """On the kernel thread, after start-up: receive each batch and run it right there (the SUB socket is this
        thread's from now on). SHUTDOWN is seen between batches; a kernel that never ends is the controller's hang
        timeout's business (it then kills or abandons this process)."""
        try:
            with kernel_thread_profile(self.device):  # DTORCH_WORKER_PROFILE
                while not self.stop.is_set():
                    self._recv_one(_POLL_S, inline=True)
        except BaseException as e:  # noqa: BLE001 - the process cannot go on without its batch loop
            self._fatal(f"the batch loop failed: {type(e).__name__}: {e}")

    def ack_if_idle(self) -> None:
        """Acknowledge the latest batch run (cumulative: the controller takes it for every batch up to it)."""
        seq, self.unacked = self.unacked, None
        if seq is not None:
            try:
                self.pusher.send({"ack": seq}, kind=MessageKind.ACK)
            except TransportError:
                pass

    def _recv_one(self, timeout: float, *, inline: bool = False) -> None:
        try:
            msg = None
            if self.unacked is not None:  # acknowledge only when no further batch is waiting already
                msg = self.sub.recv(0)
                if msg is None:
                    self.ack_if_idle()
            if msg is None:
                msg = self.sub.recv(timeout)
        except SequenceError as e:
            self._fatal(f"lost batch messages: {e}")
            return
        if msg is None:
            return
        if msg.kind == MessageKind.BATCH:
            try:
                batch = self.decoder.decode(msg.body)
            except Exception as e:  # noqa: BLE001 - the instruction stream cannot continue
                self._fatal(f"could not decode batch {msg.seq} from {msg.sender!r}: {type(e).__name__}: {e}")
                return
            run = BatchRun(self, msg.seq, batch)
            if inline:
                run()
            else:  # during start-up (the main thread answers the handshake): after the communicator is built
                self.stream.submit(run)
        elif msg.kind == MessageKind.SHUTDOWN:
            log.debug("worker %s: shutdown requested", self.worker_id)
            # goodbye first: from now on the controller closing its heartbeat streams is expected, not a death
            self.hb.stop()
            self.stop.set()
        else:
            self._report_reject(TransportError(f"unexpected {msg.kind.name} on the batch stream"))

    def _data_loop(self) -> None:

        sock = self.control
        assert sock is not None
        expected = 1
        try:
            while not self.stop.is_set():
                if not sock.poll(round(_POLL_S * 1000), zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    msg = decode(frames, secret=self.secret)
                    if msg.session != self.data_session:
                        raise TransportError(f"upload from another session ({msg.session:#x}) dropped")
                    if msg.seq < expected:
                        raise SequenceError(
                            sender=msg.sender, expected=expected, got=msg.seq, session=msg.session
                        )
                except TransportError as e:
                    self._report_reject(e)
                    continue
                if msg.seq > expected:
                    self._fatal(f"lost uploads: expected seq {expected}, got {msg.seq}")
                    return
                expected += 1
                ipc = self.ipc
                if msg.kind == MessageKind.ACK and ipc is not None and isinstance(msg.body, dict):
                    try:  # the controller copied a fetched value shared by CUDA IPC (or resend it)
                        ipc.acknowledged(msg.body)
                    except Exception as e:  # noqa: BLE001
                        self._report_reject(TransportError(f"bad CUDA IPC acknowledgement: {e}"))
                    continue
                if msg.kind != MessageKind.VALUE:
                    self._report_reject(TransportError(f"unexpected {msg.kind.name} on the control socket"))
                    continue
                try:
                    if ipc is not None and is_ipc_body(msg.body):
                        kv = ipc.receive(msg.body)  # None: could not open, the controller resends it
                    else:
                        kv = value_from_body(msg.body, device=self.device, shm=self.shm, direction="u")
                except Exception as e:  # noqa: BLE001 - the upload is lost: its Upload instruction will wait
                    self._fatal(f"could not read upload {msg.seq}: {type(e).__name__}: {e}")
                    return
                if kv is not None:
                    self.store.deliver(*kv)
        except zmq.ZMQError as e:
            if not self.stop.is_set():
                log.error("worker %s: control socket failed: %s", self.worker_id, e)

    # --- replies ------------------------------------------------------------------------------------------------
    def _send_value(self, device: int, key: Any, value: Any) -> None:
        ipc, body = self.ipc, None
        if ipc is not None:  # a CUDA IPC handle, or None: another route (or sharing failed)
            body = ipc.value_body(key, value, shm=self.shm is not None)
        if body is None:
            body = self._host_body(key, value)
        ack = self.ack_with_value
        if ack is not None:  # the batch ends with this reply: acknowledge it here (see BatchRun)
            body["ack"] = ack
            self.ack_with_value = None
        self._add_mem_free(body)
        self.pusher.send(body, kind=MessageKind.VALUE)

    def _add_mem_free(self, body: dict[str, Any]) -> None:
        """Tell the controller's memory pre-check how much memory this device has free now (CUDA devices and
        workers that may run on another host; local CPU workers share the controller's RAM, which it reads)."""
        if not getattr(self, "_report_memory", False):
            return
        try:
            if self._torch_device.type == "cuda":
                body["mem_free"] = cuda_free_bytes(self._torch_device)
            else:
                free = host_available_bytes()
                if free is not None:
                    body["mem_free"] = free
        except Exception as e:  # noqa: BLE001 - no figure: the controller does not check this device
            log.debug("worker %s: no free-memory figure: %s", self.worker_id, e)

    def _host_body(self, key: Any, value: Any) -> dict[str, Any]:

        return value_body(key, value, shm=self.shm, threshold=self.shm_threshold, direction="f")

    def _report_reject(self, err: TransportError) -> None:
        """Count a dropped message; the controller hears of the first at once, of the next ones at most once per
        ``_REJECT_REPORT_S`` (with their count): a flood costs neither memory nor one reply per message."""
        n = self.rejects.add(str(err), kind=type(err).__name__)
        if n:
            self._forward_rejects(n, str(err))

    def _forward_rejects(self, count: int, text: str) -> None:
        pusher = getattr(self, "pusher", None)
        if pusher is not None and not pusher.closed:
            try:
                pusher.send({"rejected": text, "count": count}, kind=MessageKind.ERROR)
            except TransportError:
                pass

    def _fatal(self, text: str) -> None:
        log.error("worker %s: %s", self.worker_id, text)
        try:
            self.pusher.send({"fatal": text}, kind=MessageKind.ERROR)
        except TransportError:
            pass
        self.exit_code = EXIT_ERROR
        self.stop.set()

    def _close(self) -> None:
        # A ZMQ socket must not be closed while another thread polls it (libzmq may abort the process, which then
        # exits with a signal instead of 0): close each one only once the thread that owns it is done with it.
        stream = getattr(self, "stream", None)
        kernel_done = stream is None or stream.close(discard=True, timeout=1.0)
        if not kernel_done:
            log.warning("worker %s: the kernel thread is still busy at exit (left behind)", self.worker_id)
        data = getattr(self, "_data_thread", None)
        if data is not None:
            data.join(1.0)
        data_done = data is None or not data.is_alive()
        hb = getattr(self, "hb", None)
        if hb is not None:
            hb.stop()
        sub = getattr(self, "sub", None)
        if sub is not None and kernel_done:
            sub.close()
        if self.control is not None and data_done:
            self.control.close(linger=0)
        pusher = getattr(self, "pusher", None)
        if pusher is not None:
            pusher.close_after_flush()
        if self.shm is not None:
            self.shm.close()  # attached: the controller owns (and removes) the directory
        if self.ipc is not None:
            self.ipc.close()
