"""``ClusterRunner``: one worker **process** per device, local (spawned here) or remote (``dtorch worker``).

Same interface as :class:`~torch_dtorch.executor.thread_runner.ThreadRunner` (``devices``, ``store``,
``submit(batch)``, ``wait_idle``, ``shutdown``), same instructions and kernels: each worker process wraps the
thread-mode :class:`~torch_dtorch.executor.worker.Worker`. What differs is the plumbing (see
:mod:`~torch_dtorch.cluster.protocol` for the sockets):

1. start-up (:mod:`~torch_dtorch.cluster.startup`): a per-cluster secret, a heartbeat monitor, a
   ``TCPStore`` for the ``torch.distributed`` rendezvous, the sockets, local workers spawned, signed
   ``JOIN``/``WELCOME``, the PUB/SUB handshake, every worker ready. Anything missing after ``start_timeout_s``
   raises :class:`WorkerStartError` naming it.
2. work: batches are encoded by the codec and published in order, when the :mod:`~torch_dtorch.cluster.outbox`
   says so (at once while workers keep up, gathered while they are busy); uploads go to their worker's control socket
   (large ones to local workers through the shared-memory store, large CUDA ones as CUDA IPC handles:
   :mod:`~torch_dtorch.cluster.ipc`); values, barrier markers and acks come back on the PULL socket (a
   receiver thread, :mod:`~torch_dtorch.cluster.replies`, which also refuses late JOINs on the control socket).
   The memory pre-check's pools: :mod:`~torch_dtorch.cluster.pools`.
3. failure: a worker that dies (heartbeat stream breaks, or its process exits) or stops beating for
   ``DTORCH_HEARTBEAT_TIMEOUT_S`` fails the runner with :class:`WorkerLostError` (worker, host, last op); one busy on
   one op beyond ``DTORCH_HANG_TIMEOUT_S`` with :class:`WorkerHangError`. Every pending and later value request
   raises it, the other workers are shut down (no process is left behind), and the CUDA tensors held for the
   workers' IPC handles are dropped.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.cluster.codec import BatchEncoder
from torch_dtorch.cluster.heartbeat import HeartbeatError, WorkerHangError, WorkerLostError
from torch_dtorch.cluster.ipc import CudaIpcError, IpcAck, IpcOutbox, is_ipc_body
from torch_dtorch.cluster.joins import Member, reap_local_workers
from torch_dtorch.cluster.outbox import CHUNK, Outbox
from torch_dtorch.cluster.pools import memory_pools
from torch_dtorch.cluster.protocol import (
    DEFAULT_BATCH_SIZE,
    ClusterConfig,
    WorkerFailedError,
    WorkerStartError,
    new_secret,
    read_secret_file,
)
from torch_dtorch.cluster.replies import Replies
from torch_dtorch.cluster.startup import ClusterStartup
from torch_dtorch.cluster.store import ControllerStore, Route, tensor_route, value_body
from torch_dtorch.cluster.transport import MessageKind, TransportError
from torch_dtorch.cluster.transport.rejects import RejectLog
from torch_dtorch.cluster.transport.tempdirs import private_dir
from torch_dtorch.collectives.group import collective_timeout_s
from torch_dtorch.config import get_config
from torch_dtorch.executor.instructions import Instruction
from torch_dtorch.executor.memory_check import MemoryPool

__all__ = ["ClusterRunner"]

log = logging.getLogger(__name__)

_EXIT_GRACE_S = 3.0


class ClusterRunner:
    """Workers as processes (see the module docstring).

    Args:
        devices: device ids (worker ranks), one process each.
        device_type: ``"cpu"`` (Gloo) or ``"cuda"`` (NCCL; device ``i`` on ``cuda:i`` of its host).
        simulate: every CUDA worker on ``cuda:0`` (virtual ranks).
        validate: workers check every kernel's outputs (default: ``DTORCH_VALIDATE_KERNEL_IO``).
        config: :class:`ClusterConfig` (default: from the ``DTORCH_CLUSTER_*`` environment variables).
        secret: the cluster secret (default: ``config.secret_file``, else a fresh random one).
    """

    def __init__(
        self,
        devices: Sequence[int],
        *,
        device_type: str = "cpu",
        simulate: bool = False,
        validate: bool | None = None,
        config: ClusterConfig | None = None,
        secret: bytes | None = None,
    ) -> None:
        self.devices = tuple(int(d) for d in devices)
        if not self.devices or len(set(self.devices)) != len(self.devices):
            raise ValueError(f"ClusterRunner: need distinct device ids, got {list(devices)}")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"ClusterRunner: device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.simulate = simulate
        self.config = config if config is not None else ClusterConfig.from_env()
        cfg = get_config()
        self.validate = cfg.validate_kernel_io if validate is None else validate
        self._debug = cfg.debug
        self._collective_timeout_s = collective_timeout_s()
        if secret is None:
            secret = read_secret_file(self.config.secret_file) if self.config.secret_file else new_secret()
        self._secret = secret
        self._encoder = BatchEncoder()
        #: instructions per chunk the executor hands over (an explicit ``DTORCH_BATCH_SIZE``, else
        #: :data:`~torch_dtorch.cluster.outbox.CHUNK`)
        self.batch_size = (
            cfg.batch_size if "DTORCH_BATCH_SIZE" in os.environ or cfg.batch_size != 64 else CHUNK
        )
        #: held work for busy workers, published at the latest at ``ClusterConfig.batch_size`` instructions
        #: (``DTORCH_CLUSTER_BATCH_SIZE``, default :data:`DEFAULT_BATCH_SIZE`)
        self.outbox = Outbox(
            self._publish, self._in_flight, max_held=self.config.batch_size or DEFAULT_BATCH_SIZE
        )
        self.members = {d: Member(d) for d in self.devices}
        self._by_id = {m.worker_id: m for m in self.members.values()}
        self.store = ControllerStore(self._send_value, timeout_s=self._collective_timeout_s)
        self._lock = threading.RLock()  # sends on PUB / control (and the join desk, which shares the socket)
        self._fail_lock = threading.Lock()
        self._acks = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None
        #: messages dropped by a worker or by this controller (unsigned, tampered, replayed): a count, the latest
        #: texts and a rate-limited log line (a flood costs neither memory nor log volume)
        self.rejected = RejectLog(log, "ClusterRunner")
        self._batches = 0
        self._tmpdir = private_dir("cluster")  # 0700: private to this user; named after this pid
        self._threads: list[threading.Thread] = []
        self._abort: threading.Thread | None = None
        self.replies = Replies(self)
        #: the sockets, stores and heartbeat monitor start-up opens
        self.net = ClusterStartup(
            devices=self.devices,
            device_type=device_type,
            simulate=simulate,
            validate=self.validate,
            debug=self._debug,
            collective_timeout_s=self._collective_timeout_s,
            config=self.config,
            secret=secret,
            tmpdir=self._tmpdir,
            members=self.members,
            on_failure=self._on_failure,
            on_reject=self._on_reject,
            on_message=self.replies.handle,
            failure=lambda: self.failure,
        )
        #: CUDA tensors shared with workers (uploads), held until each worker acknowledged its copy
        self._ipc = IpcOutbox()
        #: CUDA IPC traffic: ``sent`` (uploads shared), ``received`` (fetched values opened), ``fallback``
        self.cuda_ipc_counts: Counter[str] = Counter()
        try:
            self.net.start()
            for target, name in (
                (self.replies.loop, "dtorch-cluster-recv"),
                (self._watch_procs, "dtorch-cluster-procs"),
            ):
                thread = threading.Thread(target=target, name=name, daemon=True)
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self._stop_everything(graceful=False)
            raise

    # --- work ---------------------------------------------------------------------------------------------------
    def submit(self, batch: Sequence[Instruction]) -> None:
        """Hand ``batch`` to every worker (each runs the instructions that concern it): published now or held
        while they are busy (:mod:`~torch_dtorch.cluster.outbox`). After a failure the batch is dropped: the
        failure is raised by the next value request."""
        with self._lock:
            if self._closed or self.failure is not None:
                if self.failure is None:
                    raise RuntimeError("ClusterRunner: submit after shutdown()")
                log.debug(
                    "ClusterRunner: dropped a batch of %d after %s", len(batch), type(self.failure).__name__
                )
                return
            self.outbox.submit(batch)

    def _publish(self, batch: list[Instruction]) -> None:
        """Encode and publish one batch (the outbox calls it; callers hold ``_lock``)."""
        if self._closed or self.failure is not None:
            self.outbox.drop()
            return
        tree = self._encoder.encode(batch)
        assert self.net.pub is not None
        self._batches = self.net.pub.send(tree, kind=MessageKind.BATCH)

    def _in_flight(self) -> int:
        """Messages published that the slowest worker has not acknowledged yet."""
        return self._batches - min(m.acked for m in self.members.values())

    def released(self) -> None:
        """A worker acknowledged batches (the receiver thread): held work goes out once few enough are in flight."""
        if len(self.outbox) and self._in_flight() < self.outbox.window:
            with self._lock:
                if not self._closed and self.failure is None:
                    self.outbox.on_ack()

    def _send_value(self, device: int, key: Any, value: Any) -> None:
        m = self.members.get(device)
        if m is None or m.identity is None:
            raise ValueError(f"ClusterRunner: no worker for device {device} (devices {list(self.devices)})")
        if self.failure is not None:
            raise self.failure
        body = self._upload_body(m, key, value)
        try:
            self._send_control(m, body, kind=MessageKind.VALUE)
        except BaseException:
            if is_ipc_body(body):  # never sent: nobody will open it
                self._ipc.release(IpcAck(key, ok=False, opened=False, error="not sent"))
            raise

    def _upload_body(self, m: Member, key: Any, value: Any) -> dict[str, Any]:
        """The ``VALUE`` body of an upload to ``m``: a CUDA IPC handle, a shared-memory file or frames."""
        threshold = self.config.shm_threshold
        route = tensor_route(
            value, same_host=m.local, threshold=threshold, shm=self.net.shm is not None, cuda_ipc=m.cuda_ipc
        )
        if route is Route.CUDA_IPC:
            device = torch.device("cuda", m.cuda_index) if m.cuda_index is not None else None
            try:
                body = self._ipc.share(key, value, device=device)  # on the worker's GPU, held until it copied
                self.cuda_ipc_counts["sent"] += 1
                return body
            except CudaIpcError as e:
                log.warning("ClusterRunner: %s; CUDA IPC off for %s (host memory instead)", e, m.worker_id)
                m.cuda_ipc = False
                self.cuda_ipc_counts["fallback"] += 1
        shm = self.net.shm if m.local else None
        return value_body(key, value, shm=shm, threshold=threshold, direction="u")

    def _send_control(self, m: Member, body: dict[str, Any], *, kind: MessageKind) -> None:
        """Send ``body`` to ``m`` on its control socket (uploads, CUDA IPC acknowledgements)."""
        assert self.net.desk is not None and self.net.control is not None and m.identity is not None
        with self._lock:
            if self.failure is not None:
                raise self.failure
            m.seq += 1
            frames = self.net.desk.encode(body, kind=kind, seq=m.seq)
            self.net.control.send_multipart([m.identity, *frames], copy=False)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every worker acknowledged every batch submitted so far (tests, benchmarks, the memory
        pre-check's idle test); held work is published first."""
        if len(self.outbox):
            if timeout == 0:
                return False
            with self._lock:
                if not self._closed and self.failure is None:
                    self.outbox.flush()
        target = self._batches
        with self._acks:
            return self._acks.wait_for(
                lambda: self.failure is not None or all(m.acked >= target for m in self.members.values()),
                timeout,
            )

    def _watch_procs(self) -> None:
        """Local workers: a process that exits without being asked is lost (faster than any heartbeat)."""
        while not self._closed and self.failure is None:
            m = next(
                (m for m in self.members.values() if m.proc is not None and m.proc.poll() is not None), None
            )
            if m is not None and m.proc is not None and not self._closed:
                st = self.net.monitor.workers().get(m.worker_id) if self.net.monitor is not None else None
                code = m.proc.returncode
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                reason = f"process {m.proc.pid} ended ({why})"
                last = st.last_op if st is not None else None
                self._on_failure(WorkerLostError(m.worker_id, host=m.host, last_op=last, reason=reason))
                return
            time.sleep(0.05)

    def memory_pools(self) -> list[MemoryPool]:
        """The memory the controller's pre-check watches (:mod:`torch_dtorch.cluster.pools`)."""
        return memory_pools(self.members.values(), device_type=self.device_type)

    # --- failure ------------------------------------------------------------------------------------------------
    def _on_reject(self, err: TransportError, *, count: int = 1) -> None:
        self.rejected.add(str(err), kind=type(err).__name__, count=count)

    def _on_failure(self, err: BaseException) -> None:
        with self._fail_lock:  # not self._lock: a sender holding it must not delay the failure
            if self.failure is not None or self._closed:
                return
            self.failure = err
        log.error("ClusterRunner: %s; shutting the other workers down", err)
        self.store.fail(err)
        with self._acks:
            self._acks.notify_all()
        abort = threading.Thread(target=self._stop_everything, name="dtorch-cluster-abort", daemon=True)
        abort.start()  # published once started: shutdown() may join it at any moment after
        self._abort = abort

    @property
    def closed(self) -> bool:
        return self._closed or self.failure is not None

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def check(self) -> None:
        """Raise the failure that ended this cluster, if any."""
        if self.failure is not None:
            raise self.failure

    # --- shutdown -----------------------------------------------------------------------------------------------
    def shutdown(self, *, timeout: float = 10.0) -> None:
        """Ask every worker to exit, wait for local processes (``timeout``), kill what is left. Idempotent."""
        with self._lock:
            abort = self._abort
            closed = self._closed
            if not closed and self.failure is None:
                self.store.close()
        if abort is not None and abort is not threading.current_thread():
            abort.join(timeout + _EXIT_GRACE_S + 5.0)  # a failure is being cleaned up: wait for it
        if not closed:
            self._stop_everything(graceful=True, timeout=timeout)

    def _stop_everything(self, *, graceful: bool = False, timeout: float = _EXIT_GRACE_S) -> None:
        with self._lock:
            first = not self._closed
            if (
                first
                and graceful
                and self.failure is None
                and self.net.pub is not None
                and self.net.pub.connected
            ):
                try:  # held work goes before SHUTDOWN (workers take it between batches)
                    self.outbox.flush()
                except Exception as e:  # noqa: BLE001 - shutting down anyway
                    log.warning("ClusterRunner: could not send held work at shutdown: %s", e)
            self.outbox.drop()
            self._closed = True
            if first and self.net.pub is not None and self.net.pub.connected:
                try:
                    self.net.pub.send({}, kind=MessageKind.SHUTDOWN)
                except TransportError:
                    pass
        if not first:
            return
        if self.net.monitor is not None:
            for m in self.members.values():
                self.net.monitor.forget(m.worker_id)
        deadline = time.monotonic() + (timeout if graceful else _EXIT_GRACE_S)
        reap_local_workers(self.members.values(), deadline)
        dropped = self._ipc.drop(consumers_gone=True)  # after the reap: no worker can still be copying
        if dropped:
            log.info(
                "ClusterRunner: dropped %d CUDA tensors shared with workers that never copied them", dropped
            )
        remote = [m.worker_id for m in self.members.values() if m.proc is None and m.identity is not None]
        if self.net.monitor is not None:
            # stopping the monitor cancels the streams: let remote workers see SHUTDOWN and say goodbye first
            if remote:
                still = self.net.monitor.wait_gone(remote, timeout_s=max(0.5, deadline - time.monotonic()))
                if still:
                    log.warning("ClusterRunner: remote workers %s did not say goodbye in time", still)
            self.net.monitor.stop()  # remote workers that are still there see the controller leave and exit
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        with self._lock:
            self.net.close()
        self.store.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def control_endpoint(self) -> str:
        """Where workers join (``dtorch worker --controller ...``)."""
        return self.net.control_endpoint

    def __enter__(self) -> ClusterRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "failed" if self.failure is not None else "closed" if self._closed else "running"
        return f"ClusterRunner(devices={list(self.devices)}, {self.device_type}, {state})"


__all__ += ["HeartbeatError", "WorkerFailedError", "WorkerHangError", "WorkerLostError", "WorkerStartError"]
