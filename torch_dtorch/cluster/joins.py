"""Members of a cluster and the control socket's join desk (used by :class:`~.cluster_runner.ClusterRunner`).

- :class:`Member`: what the controller knows about one worker (its process when local, its control-socket identity
  once joined, its host, ...);
- :func:`spawn_worker`: start a local worker process (spawn, never fork), the secret through an inherited pipe;
- :class:`JoinDesk`: answers ``JOIN`` messages on the control ``ROUTER`` socket with a ``WELCOME`` or a refusal.
  It serves during start-up *and afterwards* (the runner's receiver thread drains it), so a late JOIN with a wrong
  secret, for a device already taken or from an unexpected device is always refused and reported, never left
  unread in the socket.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import zmq

from torch_dtorch.cluster.protocol import WorkerStartError
from torch_dtorch.cluster.transport import MessageKind, TransportError
from torch_dtorch.cluster.transport.wire import decode, encode

__all__ = ["JoinDesk", "Member", "peer_address", "reap_local_workers", "spawn_worker"]

log = logging.getLogger(__name__)


class Member:
    """What the controller knows about one worker."""

    __slots__ = (
        "device",
        "worker_id",
        "proc",
        "identity",
        "host",
        "peer",
        "pid",
        "seq",
        "acked",
        "ready",
        "cuda_ipc",
        "cuda_index",
        "mem_free",
        "mem_reports",
    )

    def __init__(self, device: int) -> None:
        self.device = device
        self.worker_id = f"w{device}"
        self.proc: subprocess.Popen[bytes] | None = None  # local workers only
        self.identity: bytes | None = None  # ROUTER identity of its control socket
        self.host = ""  # as the worker reports it
        self.peer = ""  # the address its JOIN came from (TCP only)
        self.pid = 0
        self.seq = 0  # uploads sent on its control socket
        self.acked = 0  # last batch it acknowledged
        self.ready = False
        self.cuda_ipc = False  # CUDA tensors travel as IPC handles (told in its WELCOME; off after a failure)
        self.cuda_index: int | None = None  # its CUDA device index on this host (reported when ready)
        self.mem_free: int | None = None  # free bytes of its device as it last reported (CUDA, remote hosts)
        self.mem_reports = 0  # how many such reports arrived

    @property
    def local(self) -> bool:
        """Started by this controller on this host."""
        return self.proc is not None


def peer_address(frames: Sequence[Any]) -> str:
    try:
        return str(frames[0].get("Peer-Address"))
    except Exception:  # noqa: BLE001 - ipc sockets have no peer address
        return "local peer"


def spawn_worker(
    m: Member, *, control_endpoint: str, secret: bytes, start_timeout_s: float, extra_env: Mapping[str, str]
) -> None:
    """Start ``m`` as a local process (``python -m torch_dtorch.cluster.worker``) in its own session."""
    rfd, wfd = os.pipe()
    try:
        os.write(wfd, secret.hex().encode())
    finally:
        os.close(wfd)
    env = dict(os.environ)
    # the controller's intra-op thread count (a benchmark's ``torch.set_num_threads(1)`` included): N workers that
    # each took every core of a small box would oversubscribe it
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    env.update(extra_env)
    cmd = [sys.executable, "-m", "torch_dtorch.cluster.worker", "--controller", control_endpoint,
           "--device", str(m.device), "--secret-fd", str(rfd), "--start-timeout", str(start_timeout_s)]  # fmt: skip
    try:
        m.proc = subprocess.Popen(
            cmd, pass_fds=(rfd,), env=env, stdin=subprocess.DEVNULL, start_new_session=True
        )
    except OSError as e:
        raise WorkerStartError(f"ClusterRunner: could not start worker {m.worker_id} ({cmd[:3]}): {e}") from e
    finally:
        os.close(rfd)
    log.debug("ClusterRunner: started %s as pid %d", m.worker_id, m.proc.pid)


def reap_local_workers(members: Iterable[Member], deadline: float) -> None:
    """Wait until ``deadline`` (``time.monotonic()``) for every local worker process to exit; kill the others."""
    for m in members:
        p = m.proc
        if p is None:
            continue
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("ClusterRunner: worker %s (pid %d) did not exit; killing it", m.worker_id, p.pid)
            p.kill()
            try:
                p.wait(5.0)
            except subprocess.TimeoutExpired:
                log.error("ClusterRunner: worker %s (pid %d) survived SIGKILL", m.worker_id, p.pid)


class JoinDesk:
    """Answers JOINs on the control socket ``ctl`` (not thread-safe: the runner serializes its use).

    Args:
        ctl: the bound ``ROUTER`` control socket.
        secret: the cluster secret.
        session: the publisher's session id (signs the replies).
        members: device -> :class:`Member`.
        welcome: ``member -> WELCOME body`` (endpoints and settings).
        on_reject: called with each refused or undecodable message.
    """

    def __init__(
        self,
        ctl: zmq.Socket[bytes],
        *,
        secret: bytes,
        session: int,
        members: Mapping[int, Member],
        welcome: Callable[[Member], dict[str, Any]],
        on_reject: Callable[[TransportError], None],
    ) -> None:
        self.ctl = ctl
        self._secret = secret
        self._session = session
        self._members = members
        self._welcome = welcome
        self._on_reject = on_reject

    def encode(self, body: Any, *, kind: MessageKind, seq: int) -> list[Any]:
        return encode(
            body, kind=kind, seq=seq, sender="controller", secret=self._secret, session=self._session
        )

    def serve(self, timeout_s: float) -> int:
        """Answer every JOIN waiting on the socket, waiting up to ``timeout_s`` for the first; returns how many
        messages were handled."""
        n = 0
        ms = max(0, round(timeout_s * 1000))
        while self.ctl.poll(ms if n == 0 else 0, zmq.POLLIN):
            identity, *frames = self.ctl.recv_multipart(copy=False)
            self._handle(identity.bytes, frames)
            n += 1
        return n

    def _handle(self, identity: bytes, frames: list[Any]) -> None:
        try:
            msg = decode(frames, secret=self._secret)
        except TransportError as e:
            self._on_reject(TransportError(f"join from {peer_address(frames)} refused: {e}"))
            return
        body = msg.body if isinstance(msg.body, dict) else {}
        device = body.get("device")
        m = self._members.get(device) if isinstance(device, int) else None
        if msg.kind != MessageKind.JOIN or m is None or m.identity is not None:
            why = (
                "not a JOIN"
                if msg.kind != MessageKind.JOIN
                else f"device {device!r} is not expected or taken"
            )
            self._on_reject(
                TransportError(f"join from {msg.sender!r} ({peer_address(frames)}) refused: {why}")
            )
            reply = {"nonce": body.get("nonce"), "refused": why}
            self._send(identity, self.encode(reply, kind=MessageKind.WELCOME, seq=0))
            return
        m.identity = identity
        m.peer = peer_address(frames)
        m.host = str(body.get("host") or m.peer)
        m.pid = int(body.get("pid") or 0)
        welcome = dict(self._welcome(m), nonce=body.get("nonce"), worker=m.worker_id)
        self._send(identity, self.encode(welcome, kind=MessageKind.WELCOME, seq=0))
        log.debug("ClusterRunner: %s joined from %s (pid %d)", m.worker_id, m.host, m.pid)

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        try:
            self.ctl.send_multipart([identity, *frames], copy=False)
        except zmq.ZMQError as e:  # the peer went away (ROUTER_MANDATORY): nothing to answer
            log.debug("ClusterRunner: could not answer a join: %s", e)

    def missing(self, what: str) -> str:
        """The members not joined (``what="join"``) or not ready, with the state of their process."""
        waiting = [m for m in self._members.values() if not (m.ready if what == "ready" else m.identity)]
        parts = []
        for m in waiting:
            state = "remote: not joined" if m.proc is None else f"local pid {m.proc.pid}"
            if m.proc is not None and m.proc.poll() is not None:
                state = f"local process exited with code {m.proc.returncode}"
            parts.append(f"{m.worker_id} ({state})")
        return ", ".join(parts)

    def check_spawned(self) -> None:
        """Raise :class:`WorkerStartError` if a local worker exited during start-up."""
        for m in self._members.values():
            if m.proc is not None and m.proc.poll() is not None:
                raise WorkerStartError(
                    f"ClusterRunner: worker {m.worker_id} (pid {m.proc.pid}) exited with code {m.proc.returncode} "
                    "during start-up; its log is on this process's stderr"
                )
