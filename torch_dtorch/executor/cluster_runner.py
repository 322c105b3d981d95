"""``ClusterRunner``: one worker **process** per device, local (spawned here) or remote (``dtorch worker``).

Same interface as :class:`~torch_dtorch.executor.thread_runner.ThreadRunner` (``devices``, ``store``,
``submit(batch)``, ``wait_idle``, ``shutdown``), same instructions and kernels: each worker process wraps the
thread-mode :class:`~torch_dtorch.executor.worker.Worker`. What differs is the plumbing (see
:mod:`~torch_dtorch.executor.cluster_protocol` for the sockets):

1. start-up: a per-cluster secret, a heartbeat monitor, a ``TCPStore`` for the ``torch.distributed`` rendezvous,
   the PUB / PULL / control sockets; local workers are started with ``subprocess`` (spawn, never fork: torch is
   initialized here) and get the secret through an inherited pipe; every worker (local or remote) sends a signed
   ``JOIN`` and receives a ``WELCOME``; the PUB/SUB handshake; every worker reports ready once its Gloo/NCCL world
   is built. Anything missing after ``start_timeout_s`` raises :class:`WorkerStartError` naming it.
2. work: batches are encoded by the codec and published in order; uploads go to their worker's control socket
   (large ones to local workers through the shared-memory store); values, barrier markers and acks come back on the
   PULL socket (a receiver thread, which also refuses late JOINs on the control socket).
3. failure: a worker that dies (heartbeat stream breaks, or its process exits) or stops beating for
   ``DTORCH_HEARTBEAT_TIMEOUT_S`` fails the runner with :class:`WorkerLostError` (worker, host, last op); one busy on
   one op beyond ``DTORCH_HANG_TIMEOUT_S`` with :class:`WorkerHangError`. Every pending and later value request
   raises it, and the other workers are shut down (no process is left behind).
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal

import zmq

from torch_dtorch.collectives.shm_store import ShmTensorStore, cleanup_stale
from torch_dtorch.executor.cluster_joins import JoinDesk, Member, reap_local_workers, spawn_worker
from torch_dtorch.executor.cluster_protocol import (
    ClusterConfig,
    WorkerFailedError,
    WorkerStartError,
    new_secret,
    read_secret_file,
)
from torch_dtorch.executor.cluster_store import ControllerStore, value_body, value_from_body
from torch_dtorch.executor.heartbeat import HeartbeatError, HeartbeatMonitor, WorkerHangError, WorkerLostError
from torch_dtorch.executor.messages import Instruction
from torch_dtorch.executor.transport import (
    HandshakeTimeoutError,
    MessageKind,
    Publisher,
    Puller,
    TransportError,
)

__all__ = ["ClusterRunner"]

log = logging.getLogger(__name__)

_POLL_S = 0.1
_JOIN_POLL_S = 0.05  # after start-up, the receiver thread answers late JOINs this often
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
        from torch_dtorch.collectives.group import collective_timeout_s
        from torch_dtorch.config import get_config
        from torch_dtorch.executor.codec import BatchEncoder

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
        self.members = {d: Member(d) for d in self.devices}
        self._by_id = {m.worker_id: m for m in self.members.values()}
        self.store = ControllerStore(self._send_value, timeout_s=self._collective_timeout_s)
        self._lock = threading.RLock()  # sends on PUB / control (and the join desk, which shares the socket)
        self._fail_lock = threading.Lock()
        self._acks = threading.Condition()
        self._closed = False
        self.failure: BaseException | None = None
        #: messages dropped by a worker or by this controller (unsigned, tampered, replayed), as text
        self.rejected: list[str] = []
        self._batches = 0
        self._tmpdir = tempfile.mkdtemp(prefix="dtorch-cluster-")  # 0700: private to this user
        self._threads: list[threading.Thread] = []
        self._abort: threading.Thread | None = None
        self._monitor: HeartbeatMonitor | None = None
        self._tcp_store: Any = None
        self._pub: Publisher | None = None
        self._pull: Puller | None = None
        self._control: zmq.Socket[bytes] | None = None
        self._desk: JoinDesk | None = None
        self._shm: ShmTensorStore | None = None
        try:
            self._start()
        except BaseException:
            self._stop_everything(graceful=False)
            raise

    # --- start-up -----------------------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.config
        host = cfg.bind_host()
        remote = cfg.remote
        tcp = remote or cfg.transport == "tcp" or (cfg.listen or "").startswith("tcp://")
        t0 = time.monotonic()
        # heartbeat, rendezvous store, sockets
        self._monitor = HeartbeatMonitor(bind=f"{host}:0", on_lost=self._on_failure, on_hang=self._on_failure)
        hb_address = self._monitor.start()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        sock.listen(256)
        store_port = sock.getsockname()[1]
        import torch.distributed as dist

        self._tcp_store = dist.TCPStore(
            host,
            store_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self._collective_timeout_s),
            master_listen_fd=sock.fileno(),
        )
        sock.detach()  # the store owns the listening fd now
        scheme: Literal["ipc", "tcp"] = "tcp" if tcp else "ipc"
        endpoint = f"tcp://{host}:*" if tcp else None
        on_reject = self._on_reject
        self._pub = Publisher(endpoint, secret=self._secret, scheme=scheme, allow_remote=remote)
        self._pull = Puller(
            endpoint, secret=self._secret, scheme=scheme, allow_remote=remote, on_reject=on_reject
        )
        ctl: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._control = ctl
        ctl.setsockopt(zmq.SNDHWM, 0)
        ctl.setsockopt(zmq.RCVHWM, 1000)  # incoming: joins only (bounded against floods)
        ctl.setsockopt(zmq.LINGER, 0)
        ctl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        control = cfg.listen or (f"tcp://{host}:*" if tcp else f"ipc://{self._tmpdir}/control.sock")
        try:
            ctl.bind(control)
        except zmq.ZMQError as e:
            raise WorkerStartError(f"ClusterRunner: cannot bind the control endpoint {control}: {e}") from e
        self.control_endpoint = ctl.getsockopt_string(zmq.LAST_ENDPOINT)
        self._open_shm()
        self._welcome = {
            "session": self._pub.session,
            "pub": self._pub.endpoint,
            "pull": self._pull.endpoint,
            "heartbeat": hb_address,
            "store_host": host,
            "store_port": store_port,
            "world": list(self.devices),
            "device_type": self.device_type,
            "simulate": self.simulate,
            # NCCL refuses two ranks on one GPU: simulated CUDA ranks use host-staged Gloo
            "backend": "nccl" if self.device_type == "cuda" and not self.simulate else "gloo",
            "validate": self.validate,
            "debug": self._debug,
            "collective_timeout_s": self._collective_timeout_s,
            "imports": list(cfg.worker_imports),
        }
        self._desk = JoinDesk(
            ctl,
            secret=self._secret,
            session=self._pub.session,
            members=self.members,
            welcome=self._welcome_for,
            on_reject=on_reject,
        )
        for d in cfg.local(self.devices):
            spawn_worker(
                self.members[d],
                control_endpoint=self.control_endpoint,
                secret=self._secret,
                start_timeout_s=cfg.start_timeout_s,
                extra_env=cfg.extra_env,
            )
        deadline = t0 + cfg.start_timeout_s
        self._accept_joins(deadline)
        self._handshake(deadline)
        self._wait_ready(deadline)
        for target, name in (
            (self._receive_loop, "dtorch-cluster-recv"),
            (self._watch_procs, "dtorch-cluster-procs"),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info(
            "ClusterRunner: %d workers ready in %.2f s (control %s)",
            len(self.devices),
            time.monotonic() - t0,
            self.control_endpoint,
        )

    def _open_shm(self) -> None:
        """The shared-memory store of local workers (removed at shutdown; stale ones of dead controllers first)."""
        if self.config.shm_threshold <= 0 or not any(True for _ in self.config.local(self.devices)):
            return
        try:
            cleanup_stale()
            self._shm = ShmTensorStore(timeout_s=0)
        except OSError as e:
            log.warning("ClusterRunner: no shared-memory store (%s): every tensor travels as ZMQ frames", e)

    def _welcome_for(self, m: Member) -> dict[str, Any]:
        if m.local and self._shm is not None:
            return dict(self._welcome, shm=str(self._shm.path), shm_threshold=self.config.shm_threshold)
        return self._welcome

    def _accept_joins(self, deadline: float) -> None:
        desk = self._desk
        assert desk is not None
        while any(m.identity is None for m in self.members.values()):
            desk.check_spawned()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(
                    f"ClusterRunner: workers did not join {self.control_endpoint} within "
                    f"{self.config.start_timeout_s:g} s: {desk.missing('join')}. Start remote workers with "
                    f"`dtorch worker --controller {self.control_endpoint} --secret-file F --devices ...`, or raise "
                    "DTORCH_WORKER_START_TIMEOUT_S."
                )
            desk.serve(min(left, _POLL_S))

    def _handshake(self, deadline: float) -> None:
        """PUB/SUB handshake, in slices: a local worker that exits meanwhile fails start-up at once."""
        assert self._pub is not None and self._pull is not None and self._desk is not None
        ids = [m.worker_id for m in self.members.values()]
        while True:
            self._desk.check_spawned()
            left = deadline - time.monotonic()
            try:
                self._pub.handshake(self._pull, workers=ids, timeout=max(0.1, min(left, 1.0)))
                return
            except HandshakeTimeoutError as e:
                if left <= 1.0:
                    raise WorkerStartError(
                        f"ClusterRunner: PUB/SUB handshake: no acknowledgement from {list(e.missing)} within "
                        f"{self.config.start_timeout_s:g} s of start-up: check that they connect to "
                        f"{self._pub.endpoint} and {self._pull.endpoint} with the same cluster secret"
                    ) from e
            except TransportError as e:
                raise WorkerStartError(f"ClusterRunner: {e}") from e

    def _wait_ready(self, deadline: float) -> None:
        pull = self._pull
        assert pull is not None
        desk = self._desk
        assert desk is not None
        while not all(m.ready for m in self.members.values()):
            desk.check_spawned()
            desk.serve(0)
            if self.failure is not None:
                raise WorkerStartError(f"ClusterRunner: a worker failed during start-up: {self.failure}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(
                    f"ClusterRunner: workers not ready within {self.config.start_timeout_s:g} s (their "
                    f"collectives rendezvous did not finish): {desk.missing('ready')}"
                )
            msg = pull.recv(min(left, _POLL_S))
            if msg is not None:
                self._handle(msg)

    # --- work ---------------------------------------------------------------------------------------------------
    def submit(self, batch: Sequence[Instruction]) -> None:
        """Publish ``batch`` to every worker (each runs the instructions that concern it). After a failure the
        batch is dropped: the failure is raised by the next value request."""
        with self._lock:
            if self._closed or self.failure is not None:
                if self.failure is None:
                    raise RuntimeError("ClusterRunner: submit after shutdown()")
                log.debug(
                    "ClusterRunner: dropped a batch of %d after %s", len(batch), type(self.failure).__name__
                )
                return
            tree = self._encoder.encode(list(batch))
            assert self._pub is not None
            self._batches = self._pub.send(tree, kind=MessageKind.BATCH)

    def _send_value(self, device: int, key: Any, value: Any) -> None:
        m = self.members.get(device)
        if m is None or m.identity is None:
            raise ValueError(f"ClusterRunner: no worker for device {device} (devices {list(self.devices)})")
        if self.failure is not None:
            raise self.failure
        shm = self._shm if m.local else None
        body = value_body(key, value, shm=shm, threshold=self.config.shm_threshold, direction="u")
        assert self._desk is not None and self._control is not None
        with self._lock:
            if self.failure is not None:
                raise self.failure
            m.seq += 1
            frames = self._desk.encode(body, kind=MessageKind.VALUE, seq=m.seq)
            self._control.send_multipart([m.identity, *frames], copy=False)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every worker acknowledged every batch published so far (tests, benchmarks)."""
        target = self._batches
        with self._acks:
            return self._acks.wait_for(
                lambda: self.failure is not None or all(m.acked >= target for m in self.members.values()),
                timeout,
            )

    # --- the receiver thread ------------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        pull, desk = self._pull, self._desk
        assert pull is not None and desk is not None
        next_joins = 0.0
        while not self._closed:
            now = time.monotonic()
            if now >= next_joins:  # late JOINs: refused and reported (the socket is shared with uploads)
                next_joins = now + _JOIN_POLL_S
                with self._lock:
                    if self._closed:
                        return
                    try:
                        desk.serve(0)
                    except zmq.ZMQError:
                        return
            try:
                msg = pull.recv(_JOIN_POLL_S)
            except TransportError as e:  # a sequence gap: replies were lost
                if not self._closed:
                    self._on_failure(WorkerFailedError(f"ClusterRunner: lost worker replies: {e}"))
                return
            except zmq.ZMQError:
                return
            if msg is not None:
                self._handle(msg)

    def _handle(self, msg: Any) -> None:
        m = self._by_id.get(msg.sender)
        if m is None:
            self._on_reject(TransportError(f"reply from unknown sender {msg.sender!r} dropped"))
            return
        body = msg.body if isinstance(msg.body, dict) else {}
        if msg.kind == MessageKind.VALUE:
            try:
                shm = self._shm if m.local else None
                key, value = value_from_body(body, device=m.device, shm=shm, direction="f")
            except Exception as e:  # noqa: BLE001
                self._on_reject(TransportError(f"bad VALUE from {m.worker_id}: {e}"))
                return
            self.store.deliver(key, value)
            if isinstance(body.get("ack"), int):  # the batch that ended with this reply is done
                with self._acks:
                    m.acked = body["ack"]
                    self._acks.notify_all()
        elif msg.kind == MessageKind.ACK:
            if body.get("ready"):
                m.ready = True
            elif isinstance(body.get("ack"), int):
                with self._acks:
                    m.acked = body["ack"]
                    self._acks.notify_all()
        elif msg.kind == MessageKind.ERROR:
            if "rejected" in body:
                self._on_reject(TransportError(f"worker {m.worker_id} dropped a message: {body['rejected']}"))
            else:
                err = WorkerFailedError(
                    f"worker {m.worker_id} on host {m.host!r} failed and left the cluster: {body.get('fatal', body)}"
                )
                self._on_failure(err)

    def _watch_procs(self) -> None:
        """Local workers: a process that exits without being asked is lost (faster than any heartbeat)."""
        while not self._closed and self.failure is None:
            m = next(
                (m for m in self.members.values() if m.proc is not None and m.proc.poll() is not None), None
            )
            if m is not None and m.proc is not None and not self._closed:
                st = self._monitor.workers().get(m.worker_id) if self._monitor is not None else None
                code = m.proc.returncode
                why = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                reason = f"process {m.proc.pid} ended ({why})"
                last = st.last_op if st is not None else None
                self._on_failure(WorkerLostError(m.worker_id, host=m.host, last_op=last, reason=reason))
                return
            time.sleep(0.05)

    # --- failure ------------------------------------------------------------------------------------------------
    def _on_reject(self, err: TransportError) -> None:
        log.warning("ClusterRunner: %s", err)
        self.rejected.append(str(err))

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
            self._closed = True
            if first and self._pub is not None and self._pub.connected:
                try:
                    self._pub.send({}, kind=MessageKind.SHUTDOWN)
                except TransportError:
                    pass
        if not first:
            return
        if self._monitor is not None:
            for m in self.members.values():
                self._monitor.forget(m.worker_id)
        deadline = time.monotonic() + (timeout if graceful else _EXIT_GRACE_S)
        reap_local_workers(self.members.values(), deadline)
        remote = [m.worker_id for m in self.members.values() if m.proc is None and m.identity is not None]
        if self._monitor is not None:
            # stopping the monitor cancels the streams: let remote workers see SHUTDOWN and say goodbye first
            if remote:
                still = self._monitor.wait_gone(remote, timeout_s=max(0.5, deadline - time.monotonic()))
                if still:
                    log.warning("ClusterRunner: remote workers %s did not say goodbye in time", still)
            self._monitor.stop()  # remote workers that are still there see the controller leave and exit
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(2.0)
        with self._lock:
            for s in (self._pub, self._pull):
                if s is not None:
                    s.close()
            if self._control is not None:
                self._control.close(linger=0)
        self._tcp_store = None  # closes its listening socket
        self.store.close()
        if self._shm is not None:
            self._shm.close()  # the owner: removes the directory and whatever a killed worker left in it
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> ClusterRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "failed" if self.failure is not None else "closed" if self._closed else "running"
        return f"ClusterRunner(devices={list(self.devices)}, {self.device_type}, {state})"


__all__ += ["HeartbeatError", "WorkerHangError", "WorkerLostError"]
