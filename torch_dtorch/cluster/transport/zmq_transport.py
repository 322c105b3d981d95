"""ZMQ transport: controller PUB -> worker SUB for ordered batches, worker PUSH -> controller PULL for replies.

Every message is signed (:mod:`.wire`); receivers verify before decoding, drop and report (``on_reject``) what is
unsigned, tampered with, from another session or replayed, and raise :class:`SequenceError` on a gap (a lost
message: the ordered stream cannot continue). All sockets use HWM 0 (never drop) and linger 0 on close.

Start-up: PUB silently drops what it sends before a SUB has connected, so :meth:`Publisher.handshake` publishes
``HELLO`` probes until every expected worker's :class:`Subscriber` answered over its :class:`Pusher`; only then may
:meth:`Publisher.send` publish the first batch (seq 1). The hello carries the controller's random session id: the
subscriber and its pusher adopt it, and messages of another session are dropped (no cross-run replay).

Sockets are not thread-safe: use each object from one thread. Do not modify a tensor after sending it (its bytes
are sent zero-copy, possibly after ``send`` returns).
"""

from __future__ import annotations

import abc
import logging
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Literal
from urllib.parse import urlsplit

import zmq

from torch_dtorch.cluster.transport.errors import (
    AuthenticationError,
    HandshakeTimeoutError,
    ProtocolError,
    SequenceError,
    TransportClosedError,
    TransportError,
)
from torch_dtorch.cluster.transport.rejects import RejectLog
from torch_dtorch.cluster.transport.tempdirs import private_dir
from torch_dtorch.cluster.transport.wire import (
    Frame,
    Message,
    MessageKind,
    check_secret,
    claimed_sender,
    decode,
    encode,
)

__all__ = ["Publisher", "Puller", "Pusher", "Receiver", "RejectHandler", "Sender", "Subscriber", "Transport"]

logger = logging.getLogger(__name__)

RejectHandler = Callable[[TransportError], None]
Scheme = Literal["ipc", "tcp"]
_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def describe_peer(frames: list[zmq.Frame]) -> str:
    """Who sent ``frames``: the sender id its header claims (unverified) and, on TCP, the peer's address."""
    who = f"sender {claimed_sender(frames)} (unverified)"
    try:
        addr = frames[0].get("Peer-Address")
    except Exception:  # noqa: BLE001 - ipc sockets and plain bytes have no peer address
        addr = None
    return f"{who} at {addr}" if addr else who


class Transport(abc.ABC):
    """One end of a connection; a later process runner swaps implementations behind this interface."""

    endpoint: str

    @abc.abstractmethod
    def close(self) -> None:
        """Release the socket (idempotent)."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sender(Transport):
    @abc.abstractmethod
    def send(self, obj: Any, *, kind: MessageKind) -> int:
        """Sign and send ``obj``; return its sequence number."""


class Receiver(Transport):
    @abc.abstractmethod
    def recv(self, timeout: float | None = None) -> Message | None:
        """Next authenticated message in order, or ``None`` after ``timeout`` seconds (``None``: wait forever)."""


class _Socket:
    """Owns one ZMQ socket (+ the private temp dir of an ``ipc://`` bind)."""

    def __init__(self, socket_type: int) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(socket_type)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._tmpdir: str | None = None
        self.endpoint = ""

    def _bind(self, endpoint: str | None, scheme: Scheme, name: str, allow_remote: bool) -> None:
        if endpoint is None:
            if scheme == "ipc":
                self._tmpdir = private_dir("sock")  # mode 0700: private to this user; named after this pid
                endpoint = f"ipc://{self._tmpdir}/{name}.sock"
            elif scheme == "tcp":
                endpoint = "tcp://127.0.0.1:*"
            else:
                raise TransportError(f"unknown transport scheme {scheme!r}: use 'ipc' or 'tcp'")
        elif endpoint.startswith("tcp://") and not allow_remote:
            host = urlsplit(endpoint).hostname or ""
            if host not in _LOOPBACK and not host.startswith("127."):
                raise TransportError(
                    f"refusing to bind {endpoint}: not a loopback address. Pass allow_remote=True to accept "
                    f"remote workers (messages are still authenticated with the cluster secret)."
                )
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise TransportError(f"cannot bind {endpoint}: {e}") from e
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _connect(self, endpoint: str) -> None:
        try:
            self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            raise TransportError(f"cannot connect to {endpoint}: {e}") from e
        self.endpoint = endpoint

    @property
    def closed(self) -> bool:
        return bool(self._sock.closed)

    def _check_open(self) -> None:
        if self._sock.closed:
            raise TransportClosedError(f"socket {self.endpoint or '<unbound>'} is closed")

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _poll_frames(self, deadline: float | None) -> list[zmq.Frame] | None:
        self._check_open()
        if deadline is not None:
            ms = max(0, round((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(ms, zmq.POLLIN):
                return None
        return self._sock.recv_multipart(copy=False)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


class _SignedSender(_Socket, Sender):
    def __init__(self, socket_type: int, *, secret: bytes, sender: str, session: int) -> None:
        super().__init__(socket_type)
        self._secret = check_secret(secret)
        self.sender = sender
        self.session = session
        self._seq = 0

    def _frames(self, obj: Any, *, kind: MessageKind, seq: int, session: int | None = None) -> list[Frame]:
        session = self.session if session is None else session
        return encode(obj, kind=kind, seq=seq, sender=self.sender, secret=self._secret, session=session)

    def _send(self, obj: Any, *, kind: MessageKind, seq: int) -> None:
        self._check_open()
        self._sock.send_multipart(self._frames(obj, kind=kind, seq=seq), copy=False)

    def send(self, obj: Any, *, kind: MessageKind) -> int:
        self._seq += 1
        self._send(obj, kind=kind, seq=self._seq)
        return self._seq


class Pusher(_SignedSender):
    """Worker -> controller replies (PUSH, connects). ``session`` is adopted from the controller's hello."""

    def __init__(self, endpoint: str, *, secret: bytes, sender: str, session: int = 0) -> None:
        super().__init__(zmq.PUSH, secret=secret, sender=sender, session=session)
        self._connect(endpoint)


class Publisher(_SignedSender):
    """Controller -> workers ordered batches (PUB, binds; default: a private ``ipc://`` path, or
    ``tcp://127.0.0.1:<free port>`` with ``scheme="tcp"``). ``endpoint`` is the real address to connect to."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        secret: bytes,
        sender: str = "controller",
        scheme: Scheme = "ipc",
        allow_remote: bool = False,
    ) -> None:
        super().__init__(zmq.PUB, secret=secret, sender=sender, session=secrets.randbits(63) + 1)
        self._bind(endpoint, scheme, "pub", allow_remote)
        self.connected: frozenset[str] = frozenset()

    def send(self, obj: Any, *, kind: MessageKind = MessageKind.BATCH) -> int:
        if kind == MessageKind.HELLO:
            raise TransportError("HELLO is sent by handshake() only")
        if not self.connected:
            raise TransportError(
                "call handshake() before publishing: PUB drops messages sent before SUBs connect"
            )
        return super().send(obj, kind=kind)

    def handshake(
        self, puller: Puller, *, workers: Iterable[str], timeout: float = 10.0, interval: float = 0.002
    ) -> None:
        """Publish hello probes (backing off from ``interval`` to 0.1 s) until every worker in ``workers`` has
        answered on ``puller``; raise :class:`HandshakeTimeoutError` naming the silent ones after ``timeout``.
        Other messages that arrive meanwhile stay queued on ``puller``."""
        expected = frozenset(workers)
        pending = set(expected)
        nonce = secrets.token_hex(16)
        puller.session = self.session
        start = time.monotonic()
        deadline = start + timeout
        next_probe = start
        while pending:
            now = time.monotonic()
            if now >= deadline:
                raise HandshakeTimeoutError(missing=pending, timeout=timeout)
            if now >= next_probe:
                self._send({"nonce": nonce}, kind=MessageKind.HELLO, seq=0)
                next_probe = now + interval
                interval = min(interval * 2, 0.1)
            msg = puller._recv_raw(min(next_probe, deadline))
            if msg is None:
                continue
            if (
                msg.kind == MessageKind.HELLO_ACK
                and isinstance(msg.body, dict)
                and msg.body.get("nonce") == nonce
            ):
                pending.discard(msg.sender)
            else:
                puller._backlog.append(msg)
        self.connected = self.connected | expected
        logger.debug("handshake with %d worker(s) took %.3f s", len(expected), time.monotonic() - start)


class _SignedReceiver(_Socket, Receiver):
    def __init__(self, socket_type: int, *, secret: bytes, on_reject: RejectHandler | None) -> None:
        super().__init__(socket_type)
        self._secret = check_secret(secret)
        self._on_reject = on_reject or self._log_reject
        self.rejected = 0
        self._reject_log = RejectLog(logger, type(self).__name__)
        self.session: int | None = None

    def _log_reject(self, err: TransportError) -> None:
        self._reject_log.add(str(err), kind=type(err).__name__)

    def _reject(self, err: TransportError) -> None:
        self.rejected += 1
        self._on_reject(err)

    def _authenticated(self, frames: list[zmq.Frame]) -> Message | None:
        try:
            msg = decode(frames, secret=self._secret)
        except (AuthenticationError, ProtocolError) as e:
            self._reject(type(e)(f"{e} [peer: {describe_peer(frames)} on {self.endpoint}]"))
            return None
        if self.session is None:
            self.session = msg.session
        elif msg.session != self.session:
            self._reject(AuthenticationError(f"message from another session ({msg.session:#x}) dropped"))
            return None
        return msg

    def _check_seq(self, msg: Message, expected: int) -> bool:
        """True if ``msg`` is next; False (reported, dropped) if replayed; raises on a gap."""
        if msg.seq == expected:
            return True
        err = SequenceError(sender=msg.sender, expected=expected, got=msg.seq, session=msg.session)
        if msg.seq < expected:
            self._reject(err)
            return False
        raise err


class Puller(_SignedReceiver):
    """Controller end of worker replies (PULL, binds); checks each sender's sequence numbers."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        secret: bytes,
        scheme: Scheme = "ipc",
        allow_remote: bool = False,
        on_reject: RejectHandler | None = None,
    ) -> None:
        super().__init__(zmq.PULL, secret=secret, on_reject=on_reject)
        self._bind(endpoint, scheme, "pull", allow_remote)
        self._next: dict[str, int] = {}
        self._backlog: deque[Message] = deque()

    def _recv_raw(self, deadline: float | None) -> Message | None:
        while True:
            frames = self._poll_frames(deadline)
            if frames is None:
                return None
            msg = self._authenticated(frames)
            if msg is None:
                continue
            expected = self._next.get(msg.sender, 1)
            if self._check_seq(msg, expected):
                self._next[msg.sender] = expected + 1
                return msg

    def recv(self, timeout: float | None = None) -> Message | None:
        if self._backlog:
            return self._backlog.popleft()
        return self._recv_raw(_deadline(timeout))


class Subscriber(_SignedReceiver):
    """Worker end of the ordered batch stream (SUB, connects). Answers the controller's hellos through ``reply``
    (the worker's :class:`Pusher`) and returns the other messages, whose seqs must be 1, 2, 3, ..."""

    def __init__(
        self,
        endpoint: str,
        *,
        secret: bytes,
        reply: Pusher | None = None,
        on_reject: RejectHandler | None = None,
    ) -> None:
        super().__init__(zmq.SUB, secret=secret, on_reject=on_reject)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._connect(endpoint)
        self._reply = reply
        self._answered: set[str] = set()
        self._next = 1

    def recv(self, timeout: float | None = None) -> Message | None:
        deadline = _deadline(timeout)
        while True:
            frames = self._poll_frames(deadline)
            if frames is None:
                return None
            msg = self._authenticated(frames)
            if msg is None:
                continue
            if msg.kind == MessageKind.HELLO:
                self._answer_hello(msg)
            elif self._check_seq(msg, self._next):
                self._next += 1
                return msg

    def _answer_hello(self, msg: Message) -> None:
        nonce = msg.body.get("nonce") if isinstance(msg.body, dict) else None
        if not isinstance(nonce, str):
            self._reject(ProtocolError(f"hello without a nonce: {msg.body!r}"))
            return
        if nonce in self._answered or self._reply is None:
            return
        self._answered.add(nonce)
        self._reply.session = msg.session
        self._reply.send({"nonce": nonce}, kind=MessageKind.HELLO_ACK)
