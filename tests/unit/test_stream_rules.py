"""The stream-ordering rules of a worker (runtime/stream.py), checked on the CPU with fake CUDA streams.

:class:`FakeStreams` is a :class:`KernelStream` that says it is CUDA but runs on the CPU: its three primitives
(event record, event wait, ``record_stream``) write to a :class:`Ledger` instead of the driver, and it checks at every
cross-stream read (``wait_for``) what a real GPU would need:

- the blob was stamped (someone recorded which stream wrote it and an event after the write);
- a write on another stream was waited for (its event);
- the memory was allocated on the reading stream, or ``record_stream``-ed there (else the caching allocator may hand
  it out again while the read is still queued: issue 17).

Tensors the workers take from the store were allocated by another thread (CUDA IPC uploads, controller tensors):
the ledger marks them "foreign". The thread-mode pool is built with these streams and the randomized interleaved
program of tests/cluster/stream_stress.py runs on it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.cluster.stream_stress import run_interleaved_program
from torch_dtorch import Replicate, Shard
from torch_dtorch.collectives.store import MemoryTensorStore
from torch_dtorch.executor import thread_runner
from torch_dtorch.runtime.blob import Blob
from torch_dtorch.runtime.stream import COMM, COMPUTE, KernelStream

FOREIGN = "foreign"


class FakeEvent:
    """An event recorded on stream ``kind`` after its ``seq`` first writes (streams run in order)."""

    def __init__(self, kind: str, seq: int) -> None:
        self.kind = kind
        self.seq = seq

    def synchronize(self) -> None:
        pass


class Ledger:
    """What the fake streams saw: where each storage was allocated, where it was recorded, which events were
    waited on by which stream, and every broken rule."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.home: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self.recorded: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
        self.writes: dict[str, int] = {}  # per stream: how many writes were stamped on it
        self.written: dict[int, tuple[Blob, str, int]] = {}  # id(blob) -> (blob, stream, its write's number)
        # storage -> (stream, write number) of its last write through any blob (an in-place write to a base is a
        # write to every view of it)
        self.storage_last: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()
        self.ordered: dict[
            tuple[str, str], int
        ] = {}  # (reader, writer) -> writes of writer the reader follows
        self.violations: list[str] = []
        self.checked = 0

    def stamped(self, b: Blob, kind: str) -> None:
        with self.lock:
            n = self.writes[kind] = self.writes.get(kind, 0) + 1
            self.written[id(b)] = (b, kind, n)
            if b.tensor is not None:
                self.storage_last[b.tensor.untyped_storage()] = (kind, n)

    def event(self, kind: str) -> FakeEvent:
        with self.lock:
            return FakeEvent(kind, self.writes.get(kind, 0))

    def wait(self, reader: str, event: FakeEvent) -> None:
        with self.lock:
            key = (reader, event.kind)
            self.ordered[key] = max(self.ordered.get(key, 0), event.seq)

    def allocated(self, t: torch.Tensor, where: str) -> None:
        with self.lock:
            self.home.setdefault(t.untyped_storage(), where)

    def record(self, t: torch.Tensor, kind: str) -> None:
        with self.lock:
            self.recorded.setdefault(t.untyped_storage(), set()).add(kind)

    def check_read(self, b: Blob, kind: str) -> None:
        t = b.tensor
        assert t is not None
        s = t.untyped_storage()
        with self.lock:
            self.checked += 1
            if b.stream is None:
                self.violations.append(
                    f"{kind} reads {b!r}, which no stream stamped (no event to order after)"
                )
                return
            home = self.home.get(s)
            if home is None:
                self.violations.append(f"{kind} reads {b!r}, whose allocation nobody saw")
            elif home != kind and kind not in self.recorded.get(s, ()):
                self.violations.append(
                    f"{kind} reads {b!r}, allocated on {home}, without record_stream({kind})"
                )
            if b.stream != kind:
                _, writer, n = self.written.get(id(b), (b, b.stream, 1 << 60))
                if self.ordered.get((kind, writer), 0) < n:
                    self.violations.append(f"{kind} reads {b!r}, written on {writer}, without waiting for it")
            last = self.storage_last.get(s)
            own = self.written.get(id(b))
            if (
                last is not None
                and (own is None or (own[1], own[2]) != last)  # (the blob's own write is checked above)
                and last[0] != kind
                and self.ordered.get((kind, last[0]), 0) < last[1]
            ):
                self.violations.append(
                    f"{kind} reads {b!r}, whose storage was last written on {last[0]} through an alias, without "
                    "waiting for that write"
                )


class FakeStreams(KernelStream):
    """A KernelStream that claims CUDA and writes the CUDA primitives to :attr:`ledger`."""

    ledger = Ledger()

    def __init__(self, torch_device: torch.device | str, *, name: str = "dtorch-worker") -> None:
        super().__init__(torch_device, name=name)
        self.is_cuda = True
        self._streams = {COMPUTE: COMPUTE, COMM: COMM}

    @contextlib.contextmanager
    def use(self, kind: str) -> Iterator[None]:
        yield

    def _event(self, kind: str) -> Any:
        return self.ledger.event(kind)

    def _wait_event(self, kind: str, event: Any) -> None:
        self.ledger.wait(kind, event)

    def _record_stream(self, tensor: torch.Tensor, kind: str) -> None:
        self.ledger.record(tensor, kind)

    def stamp(self, blobs: Iterable[Blob], kind: str) -> None:
        blobs = list(blobs)
        super().stamp(blobs, kind)
        for b in blobs:
            self.ledger.stamped(b, kind)
            if b.tensor is not None:
                self.ledger.allocated(b.tensor, kind)  # a view keeps the home of the storage it views

    def adopt(self, tensor: torch.Tensor, kind: str) -> torch.Tensor:
        self.ledger.allocated(tensor, FOREIGN)
        return super().adopt(tensor, kind)

    def wait_for(self, blobs: Iterable[Blob | None], kind: str) -> None:
        blobs = list(blobs)
        super().wait_for(blobs, kind)
        for b in blobs:
            if b is not None and b.tensor is not None:
                self.ledger.check_read(b, kind)

    def synchronize(self) -> None:
        pass

    def synchronize_device(self) -> None:
        pass


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[Ledger]:
    dt.shutdown()
    ledger = Ledger()
    monkeypatch.setattr(FakeStreams, "ledger", ledger)
    monkeypatch.setattr(thread_runner, "KernelStream", FakeStreams)
    pop = MemoryTensorStore.pop

    def pop_foreign(self: MemoryTensorStore, key: Any, timeout: float | None = None) -> Any:
        value = pop(self, key, timeout)
        if isinstance(value, torch.Tensor) and threading.current_thread().name.startswith("dtorch-worker"):
            ledger.allocated(
                value, FOREIGN
            )  # made by the controller's thread (or copied in by an IPC thread)
        return value

    monkeypatch.setattr(MemoryTensorStore, "pop", pop_foreign)
    try:
        yield ledger
    finally:
        dt.shutdown()


def test_the_interleaved_program_keeps_every_rule(fake_pool: Ledger) -> None:
    mesh = dt.init_device_mesh("cpu", (2,))
    result = run_interleaved_program(mesh, seed=3, steps=400, rows=8, cols=6)
    dt.sync()
    assert result.redistributes > 20
    assert fake_pool.checked > 300, "the fake streams saw no cross-stream reads: are they in use?"
    assert fake_pool.violations == [], "\n".join(fake_pool.violations[:10])


def test_a_replicated_operand_sliced_for_a_sharded_peer(fake_pool: Ledger) -> None:
    """The repro of issue 17: the R -> S(0) slice of ``m`` (comm stream) read by the add (compute stream)."""
    mesh = dt.init_device_mesh("cpu", (2,))
    acc = dt.distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    m = dt.distribute_tensor(torch.ones(4, 4), mesh, [Replicate()])
    for _ in range(3):
        acc = acc + m
    torch.testing.assert_close(acc.full_tensor(), torch.full((4, 4), 3.0))
    assert fake_pool.violations == [], "\n".join(fake_pool.violations)


@pytest.mark.parametrize("n", [1, 2])
def test_a_copy_view_refresh_waits_for_the_write_to_its_base(fake_pool: Ledger, n: int) -> None:
    """Found on an H100 (tests/eager/test_copy_views.py with DTORCH_TEST_DEVICE=cuda, 4 processes on the GPU): a
    copy-view's refresh re-runs its redistribute on the comm stream, reading the view op's input -- a *view* of the
    base written in place on the compute stream. That input's blob was stamped when the view was made and had been
    waited for by the comm stream at the first refresh, so later refreshes skipped the wait and read the base before
    the write (stale rows)."""
    mesh = dt.init_device_mesh("cpu", (n,))
    a = torch.randn(5, 6)
    x = dt.distribute_tensor(a.clone(), mesh, [Shard(0)])
    views = {
        "slice_flatten": (x[1:4].view(-1), a[1:4].view(-1)),
        "chain": (x[1:4][:, 1:5].t(), a[1:4][:, 1:5].t()),
    }
    for i in range(4):
        x.add_(dt.distribute_tensor(torch.full((5, 6), 0.5 + i), mesh, [Replicate()]))
        a.add_(torch.full((5, 6), 0.5 + i))
        x.fill_(2.5 + i) if i == 2 else None
        a.fill_(2.5 + i) if i == 2 else None
        for k, (y, want) in views.items():
            torch.testing.assert_close(y.full_tensor(), want, msg=k)
    assert fake_pool.checked > 0
    assert fake_pool.violations == [], "\n".join(fake_pool.violations[:10])


def test_the_ledger_sees_a_broken_rule() -> None:
    """The checker itself: a blob written on the comm stream and read on the compute stream without the rules."""
    ledger = Ledger()
    stream = FakeStreams("cpu", name="dtorch-test-stream")
    stream.ledger = ledger
    try:
        unstamped = Blob(torch.ones(3))
        ledger.allocated(unstamped.tensor, COMM)  # type: ignore[arg-type]
        ledger.check_read(unstamped, COMPUTE)
        written = Blob(torch.ones(3))
        stream.stamp([written], COMM)
        ledger.check_read(written, COMPUTE)  # neither waited nor recorded
        assert len(ledger.violations) == 3, ledger.violations
        ledger.violations.clear()
        stream.wait_for([written], COMPUTE)  # the rules: wait for the event, record the stream
        assert ledger.violations == []
        assert written.waited == COMPUTE
    finally:
        stream.close()


def test_adopt_records_a_foreign_tensor() -> None:
    ledger = Ledger()
    stream = FakeStreams("cpu", name="dtorch-test-stream")
    stream.ledger = ledger
    try:
        t = stream.adopt(torch.ones(2), COMPUTE)
        blob = Blob(t)
        stream.stamp([blob], COMPUTE)
        ledger.check_read(blob, COMPUTE)  # same stream, but allocated elsewhere: recorded by adopt
        assert ledger.violations == []
        assert COMPUTE in ledger.recorded[t.untyped_storage()]
    finally:
        stream.close()
