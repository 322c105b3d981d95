"""Process mode on one host: same results as thread mode, separate processes, typed errors across processes, and
signed messages (tampered / replayed / unsigned ones are dropped and reported; the cluster keeps working)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.cluster.conftest import alive, leftovers, owned_paths
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.cluster.transport import MessageKind
from torch_dtorch.cluster.transport.wire import encode
from torch_dtorch.device.state import get_session


@pytest.fixture(scope="module")
def mesh(request: pytest.FixtureRequest) -> dt.DeviceMesh:
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_WORKER_IMPORTS", "tests.cluster.worker_hooks")
    mp.setenv("DTORCH_TEST_FAIL_OP", "aten.sigmoid:2")
    request.addfinalizer(mp.undo)
    return dt.init_device_mesh("cpu", (3,), mode="process")


def runner() -> ClusterRunner:
    r = get_session().executor.runner
    assert isinstance(r, ClusterRunner)
    return r


def test_workers_are_processes_and_results_equal_thread_mode(mesh: dt.DeviceMesh) -> None:
    r = runner()
    pids = [m.proc.pid for m in r.members.values() if m.proc is not None]
    assert len(pids) == 3 and os.getpid() not in pids and all(alive(p) for p in pids)
    assert get_session().mode == "process"
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(7, 10), torch.randn(13, 10), torch.randn(5, 13)
    dx = dt.distribute_tensor(x, mesh, [Shard(0)])
    y = F.linear(
        F.gelu(F.linear(dx, dt.distribute_tensor(w1, mesh, [Shard(0)]))),
        dt.distribute_tensor(w2, mesh, [Shard(1)]),
    )
    torch.testing.assert_close(y.full_tensor(), F.linear(F.gelu(F.linear(x, w1)), w2), atol=1e-5, rtol=1e-5)
    for src in (Shard(0), Shard(1), Replicate(), Partial()):
        d = dt.distribute_tensor(x, mesh, [src])
        for dst in (Shard(0), Shard(1), Replicate(), Partial()):
            torch.testing.assert_close(d.redistribute(mesh, [dst]).full_tensor(), x, atol=1e-5, rtol=1e-5)
    assert torch.equal(dx.to_local(2), x[6:])
    big = torch.randn(512, 1024)  # 2 MiB: several zero-copy frames each way
    assert torch.equal(dt.distribute_tensor(big, mesh, [Shard(1)]).full_tensor(), big)


def test_kernel_failure_is_sticky_across_processes(mesh: dt.DeviceMesh) -> None:
    x = dt.distribute_tensor(torch.randn(9, 3), mesh, [Shard(0)])
    bad = torch.sigmoid(x)  # fails on worker 2 (planted by tests.cluster.worker_hooks)
    worse = (bad * 2).redistribute(
        mesh, [Replicate()]
    )  # ranks 0 and 1 receive zeros from rank 2: poisoned too
    with pytest.raises(dt.errors.DTorchError, match=r"(?s)aten\.sigmoid.*worker 2.*planted failure"):
        worse.full_tensor()
    with pytest.raises(dt.errors.DTorchError, match="planted failure"):
        worse.to_local(0)
    torch.testing.assert_close((x + 1).full_tensor(), x.full_tensor() + 1)  # unrelated work continues


def test_communicating_kernel_after_a_failure_across_processes(mesh: dt.DeviceMesh) -> None:
    """A norm over the sharded dim exchanges partial sums between the worker processes; rank 2's input is poisoned,
    so it runs the exchange on zeros and posts its error in the store: every rank's output carries it (no hang, no
    message left over for the next exchange), and a later exchange is right."""
    value = torch.randn(9, 3)
    x = dt.distribute_tensor(value, mesh, [Shard(0)])
    norm = torch.linalg.vector_norm(torch.sigmoid(x), 2, dim=0)  # sigmoid fails on worker 2
    assert norm.placements == (Replicate(),)
    for rank in (0, 1, 2):
        with pytest.raises(dt.errors.DTorchError, match="planted failure"):
            norm.to_local(rank)
    torch.testing.assert_close(torch.linalg.vector_norm(x, 2, dim=0).full_tensor(), value.norm(dim=0))


def test_tampered_replayed_and_unsigned_messages_are_dropped_and_reported(mesh: dt.DeviceMesh) -> None:
    r = runner()
    assert r.net.pub is not None and r.net.pull is not None
    x = dt.distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    sent: list[list[bytes]] = []
    sock = r.net.pub._sock
    orig = sock.send_multipart
    sock.send_multipart = lambda frames, **kw: (sent.append([bytes(f) for f in frames]), orig(frames, **kw))[
        1
    ]  # type: ignore[method-assign]
    try:
        torch.testing.assert_close((x * 3).full_tensor(), torch.arange(6.0) * 3)
    finally:
        sock.send_multipart = orig  # type: ignore[method-assign]
    batch = sent[-1]
    before = len(r.rejected)
    with r._lock:
        tampered = [
            batch[0],
            batch[1].replace(b"3", b"4", 1) if b"3" in batch[1] else batch[1] + b" ",
            *batch[2:],
        ]
        sock.send_multipart(tampered)  # bad signature
        sock.send_multipart(batch)  # valid signature, old sequence number: a replay
        unsigned = encode({}, kind=MessageKind.ACK, seq=99, sender="w0", secret=b"x" * 32)
        push = r.net.pull._sock.context.socket(__import__("zmq").PUSH)
        push.connect(r.net.pull.endpoint)
        push.send_multipart(unsigned)
    deadline = time.monotonic() + 5
    while len(r.rejected) < before + 2 * 3 + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    push.close(linger=0)
    new = r.rejected.since(before)
    assert sum("signature does not match" in m for m in new) == 3 + 1, new  # 3 workers + the controller
    assert sum("replay" in m for m in new) == 3, new
    torch.testing.assert_close((x + 1).full_tensor(), torch.arange(6.0) + 1)  # still working, in order


def test_late_join_with_a_wrong_secret_is_refused_and_reported(mesh: dt.DeviceMesh) -> None:
    import zmq

    r = runner()
    before = len(r.rejected)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(r.control_endpoint)
        join = {"device": 9, "nonce": "n", "pid": 1, "host": "intruder"}
        sock.send_multipart(encode(join, kind=MessageKind.JOIN, seq=1, sender="w9", secret=b"x" * 32))
        deadline = time.monotonic() + 5
        while len(r.rejected) == before and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sock.close()
    new = r.rejected.since(before)
    assert new and "refused" in new[0] and "signature does not match" in new[0], new
    assert r.failure is None


def test_mode_from_environment(monkeypatch: pytest.MonkeyPatch, mesh: dt.DeviceMesh) -> None:
    monkeypatch.setenv("DTORCH_MODE", "process")
    from torch_dtorch.config import Config

    assert Config().mode == "process"
    monkeypatch.setenv("DTORCH_MODE", "bogus")
    with pytest.raises(ValueError, match="DTORCH_MODE='bogus'"):
        Config()
    with pytest.raises(ValueError, match="mode must be one of"):
        dt.init_device_mesh("cpu", (2,), mode="procs")


def test_large_tensors_travel_through_shared_memory(mesh: dt.DeviceMesh) -> None:
    r = runner()
    shm = r.net.shm
    assert shm is not None and os.path.isdir(shm.path) and r.config.shm_threshold == 1 << 20
    calls: list[tuple[str, object]] = []
    put, pop = shm.put, shm.pop
    shm.put = lambda key, t: (calls.append(("put", key)), put(key, t))[1]  # type: ignore[method-assign]
    shm.pop = lambda key, timeout=None: (calls.append(("pop", key)), pop(key, timeout))[1]  # type: ignore[method-assign]
    try:
        small = torch.randn(64, 64)  # 16 KiB: ZMQ frames
        assert torch.equal(dt.distribute_tensor(small, mesh, [Replicate()]).full_tensor(), small)
        assert calls == []
        big = torch.randn(1024, 384)  # 1.5 MiB: above the threshold for every upload and the fetch
        d = dt.distribute_tensor(big, mesh, [Replicate()])
        assert torch.equal((d * 2).full_tensor(), big * 2)
        uploads = [k for op, k in calls if op == "put" and str(k).startswith("u-")]
        assert len(uploads) == 3, calls  # one per worker
        assert [k for op, k in calls if op == "pop" and str(k).startswith("f-")], calls  # the fetch came back
        dt.sync()  # the fetch needed one replica: the other workers may not have taken their upload yet
        assert os.listdir(shm.path) == []  # every value was claimed by its receiver
    finally:
        del shm.put, shm.pop


def test_shutdown_is_graceful_and_leaves_nothing(mesh: dt.DeviceMesh) -> None:
    r = runner()
    owned = owned_paths(r)
    procs = [m.proc for m in r.members.values() if m.proc is not None]
    dt.shutdown()
    assert procs and [p.returncode for p in procs] == [0] * len(procs)  # SHUTDOWN, not "controller lost" (3)
    assert leftovers(owned) == []
