from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from torch_dtorch.cluster.transport import (
    AuthenticationError,
    HandshakeTimeoutError,
    MessageKind,
    ProtocolError,
    Publisher,
    Puller,
    Pusher,
    SequenceError,
    Subscriber,
    TransportClosedError,
    TransportError,
)

SECRET = secrets.token_bytes(32)
logger = logging.getLogger(__name__)


@pytest.fixture(autouse=True)
def _no_leaked_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    # pyzmq's process-wide GarbageCollectorThread (started by the first zero-copy send) is not ours
    leaked = [
        t
        for t in threading.enumerate()
        if t not in before and t.is_alive() and type(t).__name__ != "GarbageCollectorThread"
    ]
    assert not leaked, leaked


class Worker(threading.Thread):
    """Answers the handshake, acks every batch with the sum of its tensor, stops on SHUTDOWN."""

    def __init__(self, wid: str, pub_endpoint: str, pull_endpoint: str) -> None:
        super().__init__(name=f"worker-{wid}", daemon=True)
        self.wid, self.pub_endpoint, self.pull_endpoint = wid, pub_endpoint, pull_endpoint
        self.seqs: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                Pusher(self.pull_endpoint, secret=SECRET, sender=self.wid) as push,
                Subscriber(self.pub_endpoint, secret=SECRET, reply=push) as sub,
            ):
                while True:
                    msg = sub.recv(timeout=10.0)
                    assert msg is not None, "worker timed out"
                    if msg.kind == MessageKind.SHUTDOWN:
                        return
                    self.seqs.append(msg.seq)
                    push.send({"seq": msg.seq, "sum": msg.body["x"].sum()}, kind=MessageKind.ACK)
        except BaseException as e:  # reported to the test through .error
            self.error = e


def _join(workers: list[Worker]) -> None:
    for w in workers:
        w.join(timeout=10)
        assert not w.is_alive()
        assert w.error is None, w.error


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_handshake_then_ordered_batches_three_workers(scheme: str) -> None:
    with Publisher(secret=SECRET, scheme=scheme) as pub, Puller(secret=SECRET, scheme=scheme) as pull:  # type: ignore[arg-type]
        assert pub.endpoint.startswith(f"{scheme}://") and pull.endpoint.startswith(f"{scheme}://")
        if scheme == "tcp":
            assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":*")
        with pytest.raises(TransportError, match="handshake"):
            pub.send({"x": torch.ones(1)})
        workers = [Worker(f"w{i}", pub.endpoint, pull.endpoint) for i in range(3)]
        for w in workers:
            w.start()
        pub.handshake(pull, workers=[w.wid for w in workers], timeout=10.0)
        assert pub.connected == {"w0", "w1", "w2"}
        n = 5
        for i in range(n):
            assert pub.send({"x": torch.full((4,), float(i), dtype=torch.bfloat16)}) == i + 1
        acks: dict[str, list[tuple[int, float]]] = {w.wid: [] for w in workers}
        for _ in range(3 * n):
            msg = pull.recv(timeout=10.0)
            assert msg is not None and msg.kind == MessageKind.ACK
            acks[msg.sender].append((msg.body["seq"], msg.body["sum"].item()))
        pub.send(None, kind=MessageKind.SHUTDOWN)
        _join(workers)
        for w in workers:
            assert w.seqs == list(range(1, n + 1))
            assert acks[w.wid] == [(i + 1, 4.0 * i) for i in range(n)]
        assert pull.rejected == 0
    if scheme == "ipc":
        assert not os.path.exists(pub.endpoint.removeprefix("ipc://"))
    with pytest.raises(TransportClosedError):
        pull.recv(timeout=0)


def test_handshake_timeout_names_missing_worker() -> None:
    with Publisher(secret=SECRET) as pub, Puller(secret=SECRET) as pull:
        w0 = Worker("w0", pub.endpoint, pull.endpoint)
        w0.start()
        t0 = time.monotonic()
        with pytest.raises(HandshakeTimeoutError, match="'w1'") as info:
            pub.handshake(pull, workers=["w0", "w1"], timeout=0.3)
        assert info.value.missing == ("w1",)
        assert time.monotonic() - t0 < 2.0
        pub.handshake(pull, workers=["w0"], timeout=5.0)  # w0 answered the same way again
        pub.send(None, kind=MessageKind.SHUTDOWN)
        _join([w0])


def test_subscriber_drops_and_reports_bad_messages_and_raises_on_gap() -> None:
    rejected: list[TransportError] = []
    with (
        Publisher(secret=SECRET) as pub,
        Puller(secret=SECRET) as pull,
        Pusher(pull.endpoint, secret=SECRET, sender="w0") as push,
        Subscriber(pub.endpoint, secret=SECRET, reply=push, on_reject=rejected.append) as sub,
    ):
        got: list[Any] = []
        helper = threading.Thread(target=lambda: got.append(sub.recv(timeout=10.0)))
        helper.start()  # the subscriber must answer hellos while the handshake runs
        pub.handshake(pull, workers=["w0"], timeout=10.0)
        pub.send({"x": 1})
        helper.join()
        assert got[0].seq == 1 and got[0].body == {"x": 1}

        pub.send({"x": 2})
        pub._send({"x": 1}, kind=MessageKind.BATCH, seq=1)  # replay: signed, same session, old seq
        frames = [bytearray(f) for f in pub._frames({"x": 9}, kind=MessageKind.BATCH, seq=3)]
        frames[1][-2] ^= 0x01  # tampered payload
        pub._sock.send_multipart(frames)
        pub._sock.send_multipart([b"unsigned", b"{}"])
        pub._sock.send_multipart(
            pub._frames({"x": 3}, kind=MessageKind.BATCH, seq=3, session=pub.session + 1)
        )  # another session
        pub.send({"x": 3})
        assert [sub.recv(timeout=5.0).body["x"] for _ in range(2)] == [2, 3]  # type: ignore[union-attr]
        kinds = [type(e) for e in rejected]
        assert kinds == [SequenceError, AuthenticationError, ProtocolError, AuthenticationError], rejected
        assert isinstance(rejected[0], SequenceError) and rejected[0].kind == "replay"
        assert sub.rejected == 4

        pub._send({"x": 5}, kind=MessageKind.BATCH, seq=5)  # seq 4 never sent
        with pytest.raises(SequenceError, match="gap") as info:
            sub.recv(timeout=5.0)
        assert (info.value.expected, info.value.got) == (2 + 2, 5)


def test_puller_checks_each_senders_sequence() -> None:
    rejected: list[TransportError] = []
    with (
        Puller(secret=SECRET, on_reject=rejected.append) as pull,
        Pusher(pull.endpoint, secret=SECRET, sender="a") as a,
        Pusher(pull.endpoint, secret=SECRET, sender="b") as b,
        Pusher(pull.endpoint, secret=secrets.token_bytes(32), sender="evil") as evil,
    ):
        evil.send("forged", kind=MessageKind.ACK)
        a.send("a1", kind=MessageKind.ACK)
        a._send("a1", kind=MessageKind.ACK, seq=1)  # replay
        b.send("b1", kind=MessageKind.ACK)
        a.send("a2", kind=MessageKind.ACK)
        got = sorted(m.body for m in iter(lambda: pull.recv(timeout=0.1), None))
        assert got == ["a1", "a2", "b1"]
        assert sorted(type(e).__name__ for e in rejected) == ["AuthenticationError", "SequenceError"]
        b._send("b3", kind=MessageKind.ACK, seq=3)
        with pytest.raises(SequenceError, match="gap"):
            pull.recv(timeout=5.0)


def test_loopback_only_by_default() -> None:
    with pytest.raises(TransportError, match="allow_remote"):
        Publisher("tcp://0.0.0.0:*", secret=SECRET)
    with Puller("tcp://127.0.0.1:*", secret=SECRET) as pull:
        assert pull.endpoint.startswith("tcp://127.0.0.1:")


@pytest.mark.parametrize("path", ["push_pull", "pub_sub"])
def test_one_mib_tensor_throughput_sanity(path: str) -> None:
    x = torch.randn(256, 1024)  # 1 MiB
    n = 20
    with Puller(secret=SECRET) as pull, Pusher(pull.endpoint, secret=SECRET, sender="w0") as push:
        if path == "push_pull":
            t0 = time.perf_counter()
            for i in range(n):
                push.send({"i": i, "x": x}, kind=MessageKind.VALUE)
                msg = pull.recv(timeout=10.0)
                assert msg is not None and msg.body["i"] == i
        else:
            with Publisher(secret=SECRET) as pub, Subscriber(pub.endpoint, secret=SECRET, reply=push) as sub:
                got: list[Any] = []
                helper = threading.Thread(target=lambda: got.extend(sub.recv(timeout=10.0) for _ in range(n)))
                helper.start()
                pub.handshake(pull, workers=["w0"], timeout=10.0)
                t0 = time.perf_counter()
                for i in range(n):
                    pub.send({"i": i, "x": x})
                helper.join()
                assert [m.body["i"] for m in got] == list(range(n))
                msg = got[-1]
        dt = time.perf_counter() - t0
        assert torch.equal(msg.body["x"], x)
    logger.info("%s: %d x 1 MiB in %.3f s = %.0f MiB/s", path, n, dt, n / dt)
