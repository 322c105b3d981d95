"""Start-up of a :class:`~torch_dtorch.cluster.runner.ClusterRunner` (its :class:`ClusterStartup`, ``runner.net``):
everything between the constructor and the first batch, and the sockets and stores it opens.

1. a heartbeat monitor, a ``TCPStore`` for the ``torch.distributed`` rendezvous, the PUB / PULL / control sockets,
   the shared-memory store of local workers;
2. local workers are spawned (:func:`~torch_dtorch.cluster.joins.spawn_worker`: ``subprocess``, spawn never fork, the secret
   through an inherited pipe); every worker (local or remote) sends a signed ``JOIN`` and receives a ``WELCOME``
   (:func:`member_welcome`: endpoints and settings, the shared-memory directory and CUDA IPC for local workers);
3. the PUB/SUB handshake; every worker reports ready once its Gloo/NCCL world is built.

Anything missing after ``start_timeout_s`` raises :class:`~torch_dtorch.cluster.protocol.WorkerStartError` naming it. The
running runner (batches, replies, failures, shutdown) is :mod:`torch_dtorch.cluster.runner`; it calls
:meth:`ClusterStartup.close` also when start-up fails half-way.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import zmq

from torch_dtorch.cluster.heartbeat import HeartbeatMonitor
from torch_dtorch.cluster.joins import JoinDesk, Member, spawn_worker
from torch_dtorch.cluster.protocol import ClusterConfig, WorkerStartError
from torch_dtorch.cluster.transport import HandshakeTimeoutError, Publisher, Puller, TransportError
from torch_dtorch.cluster.transport.tempdirs import cleanup_stale_dirs
from torch_dtorch.collectives.shm_store import ShmTensorStore, cleanup_stale
from torch_dtorch.executor.worker import worker_modules

__all__ = ["ClusterStartup", "member_welcome"]

log = logging.getLogger(__name__)

POLL_S = 0.1


def member_welcome(
    base: Mapping[str, Any],
    m: Member,
    *,
    shm: ShmTensorStore | None,
    threshold: int,
    cuda_ipc: bool,
) -> dict[str, Any]:
    """The ``WELCOME`` body of ``m``: ``base`` (endpoints and settings), plus, for a worker this controller started
    on this host, the shared-memory directory and whether CUDA tensors travel as CUDA IPC handles (``cuda_ipc``:
    ``DTORCH_CUDA_IPC`` and a CUDA mesh). Remote workers get neither, even on this host."""
    out = dict(base)
    if not m.local:
        return out
    if shm is not None:
        out.update(shm=str(shm.path), shm_threshold=threshold)
    if cuda_ipc:
        out.update(cuda_ipc=True, cuda_ipc_threshold=threshold)
    return out


class ClusterStartup:
    """What start-up opens and the steps that open it (see the module docstring). Owned by a
    :class:`~torch_dtorch.cluster.runner.ClusterRunner` (``runner.net``), which hands it the settings and its
    handlers, calls :meth:`start`, and :meth:`close` at shutdown (also after a start-up that failed half-way)."""

    def __init__(
        self,
        *,
        devices: tuple[int, ...],
        device_type: str,
        simulate: bool,
        validate: bool,
        debug: bool,
        collective_timeout_s: float,
        config: ClusterConfig,
        secret: bytes,
        tmpdir: str,
        members: dict[int, Member],
        on_failure: Callable[[BaseException], None],
        on_reject: Callable[[TransportError], None],
        on_message: Callable[[Any], None],
        failure: Callable[[], BaseException | None],
    ) -> None:
        self.devices = devices
        self.device_type = device_type
        self.simulate = simulate
        self.validate = validate
        self.debug = debug
        self.collective_timeout_s = collective_timeout_s
        self.config = config
        self.members = members
        self._secret = secret
        self._tmpdir = tmpdir
        self._on_failure = on_failure
        self._on_reject = on_reject
        self._on_message = on_message
        self._failure = failure
        self.control_endpoint = ""
        self.monitor: HeartbeatMonitor | None = None
        self.tcp_store: Any = None
        self.pub: Publisher | None = None
        self.pull: Puller | None = None
        self.control: zmq.Socket[bytes] | None = None
        self.desk: JoinDesk | None = None
        self.shm: ShmTensorStore | None = None
        self.welcome: dict[str, Any] = {}

    def start(self) -> None:
        cfg = self.config
        host = cfg.bind_host()
        remote = cfg.remote
        tcp = remote or cfg.transport == "tcp" or (cfg.listen or "").startswith("tcp://")
        t0 = time.monotonic()
        removed = cleanup_stale_dirs()  # socket directories of controllers that died without shutting down
        if removed:
            log.info("ClusterRunner: removed %d socket directories of dead controllers", len(removed))
        # heartbeat, rendezvous store, sockets
        self.monitor = HeartbeatMonitor(bind=f"{host}:0", on_lost=self._on_failure, on_hang=self._on_failure)
        hb_address = self.monitor.start()
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.bind((host, 0))
        sock.listen(256)
        store_port = sock.getsockname()[1]
        import torch.distributed as dist

        self.tcp_store = dist.TCPStore(
            host,
            store_port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.collective_timeout_s),
            master_listen_fd=sock.fileno(),
        )
        sock.detach()  # the store owns the listening fd now
        scheme: Literal["ipc", "tcp"] = "tcp" if tcp else "ipc"
        endpoint = f"tcp://{host}:*" if tcp else None
        on_reject = self._on_reject
        self.pub = Publisher(endpoint, secret=self._secret, scheme=scheme, allow_remote=remote)
        self.pull = Puller(
            endpoint, secret=self._secret, scheme=scheme, allow_remote=remote, on_reject=on_reject
        )
        ctl: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.control = ctl
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
        self.welcome = {
            "session": self.pub.session,
            "pub": self.pub.endpoint,
            "pull": self.pull.endpoint,
            "heartbeat": hb_address,
            "store_host": host,
            "store_port": store_port,
            "world": list(self.devices),
            "device_type": self.device_type,
            "simulate": self.simulate,
            # NCCL refuses two ranks on one GPU: simulated CUDA ranks use host-staged Gloo
            "backend": "nccl" if self.device_type == "cuda" and not self.simulate else "gloo",
            "validate": self.validate,
            "debug": self.debug,
            "collective_timeout_s": self.collective_timeout_s,
            "imports": [*worker_modules(), *cfg.worker_imports],
        }
        self.desk = JoinDesk(
            ctl,
            secret=self._secret,
            session=self.pub.session,
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
            self.shm = ShmTensorStore(timeout_s=0)
        except OSError as e:
            log.warning("ClusterRunner: no shared-memory store (%s): every tensor travels as ZMQ frames", e)

    def _welcome_for(self, m: Member) -> dict[str, Any]:
        cuda_ipc = self.config.cuda_ipc and self.device_type == "cuda"
        m.cuda_ipc = m.local and cuda_ipc  # until a peer fails to open a handle
        return member_welcome(
            self.welcome, m, shm=self.shm, threshold=self.config.shm_threshold, cuda_ipc=cuda_ipc
        )

    def _accept_joins(self, deadline: float) -> None:
        desk = self.desk
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
            desk.serve(min(left, POLL_S))

    def _handshake(self, deadline: float) -> None:
        """PUB/SUB handshake, in slices: a local worker that exits meanwhile fails start-up at once."""
        assert self.pub is not None and self.pull is not None and self.desk is not None
        ids = [m.worker_id for m in self.members.values()]
        while True:
            self.desk.check_spawned()
            left = deadline - time.monotonic()
            try:
                self.pub.handshake(self.pull, workers=ids, timeout=max(0.1, min(left, 1.0)))
                return
            except HandshakeTimeoutError as e:
                if left <= 1.0:
                    raise WorkerStartError(
                        f"ClusterRunner: PUB/SUB handshake: no acknowledgement from {list(e.missing)} within "
                        f"{self.config.start_timeout_s:g} s of start-up: check that they connect to "
                        f"{self.pub.endpoint} and {self.pull.endpoint} with the same cluster secret"
                    ) from e
            except TransportError as e:
                raise WorkerStartError(f"ClusterRunner: {e}") from e

    def _wait_ready(self, deadline: float) -> None:
        pull = self.pull
        assert pull is not None
        desk = self.desk
        assert desk is not None
        while not all(m.ready for m in self.members.values()):
            desk.check_spawned()
            desk.serve(0)
            failure = self._failure()
            if failure is not None:
                raise WorkerStartError(f"ClusterRunner: a worker failed during start-up: {failure}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerStartError(
                    f"ClusterRunner: workers not ready within {self.config.start_timeout_s:g} s (their "
                    f"collectives rendezvous did not finish): {desk.missing('ready')}"
                )
            msg = pull.recv(min(left, POLL_S))
            if msg is not None:
                self._on_message(msg)

    def close(self) -> None:
        """Close the sockets and stores (the caller holds the send lock and has reaped the workers)."""
        for s in (self.pub, self.pull):
            if s is not None:
                s.close()
        if self.control is not None:
            self.control.close(linger=0)
        self.tcp_store = None  # closes its listening socket
        if self.shm is not None:
            self.shm.close()  # the owner: removes the directory and whatever a killed worker left in it
