"""Heartbeat: death, stop, hang and controller-loss detection (docs/reliability.md, docs/cluster.md)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from tests.cluster.heartbeat._worker import reap, spawn_worker
from torch_dtorch.cluster.heartbeat import (
    CONTROLLER_LOST_EXIT_CODE,
    ENV_DEATH_TIMEOUT,
    ENV_HANG_TIMEOUT,
    ControllerUnreachableError,
    HeartbeatClient,
    HeartbeatMonitor,
    WorkerHangError,
    WorkerLostError,
)
from torch_dtorch.cluster.heartbeat import heartbeat_pb2 as pb
from torch_dtorch.cluster.heartbeat import heartbeat_pb2_grpc as pb_grpc
from torch_dtorch.errors import DTorchError


class Recorder:
    """Callback that records (monotonic time, argument) and lets a test wait for the first call."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Any]] = []
        self.event = threading.Event()

    def __call__(self, arg: Any) -> None:
        self.calls.append((time.monotonic(), arg))
        self.event.set()

    def wait(self, timeout: float) -> tuple[float, Any]:
        assert self.event.wait(timeout), f"callback not called within {timeout} s"
        return self.calls[0]


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    spawned: list[subprocess.Popen[str]] = []
    try:
        yield spawned
    finally:
        for p in spawned:
            reap(p)


def _ready(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (
        line,
        proc.stderr.read() if proc.poll() is not None and proc.stderr else "",
    )


def _wait_until(pred: Any, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_stubs_import_and_round_trip() -> None:
    beat = pb.Beat(
        worker_id="w3", host="h", pid=7, sequence=2**40, state=pb.Beat.BUSY, op="aten.mm", sent_at=1.5
    )
    assert pb.Beat.FromString(beat.SerializeToString()) == beat
    assert hasattr(pb_grpc, "HeartbeatStub") and hasattr(pb_grpc, "add_HeartbeatServicer_to_server")
    assert issubclass(WorkerLostError, DTorchError) and issubclass(WorkerHangError, TimeoutError)


def test_sigkill_worker_is_lost_within_1s(procs: list[subprocess.Popen[str]]) -> None:
    lost = Recorder()
    with HeartbeatMonitor(interval_s=0.05, death_timeout_s=1.0, on_lost=lost) as mon:
        assert mon.address is not None
        procs.append(spawn_worker(mon.address, "worker-0"))
        _ready(procs[0])
        mon.wait_for_workers(["worker-0"], timeout_s=10)
        time.sleep(0.2)  # the busy state has been beaten over
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
        t_cb, err = lost.wait(timeout=2.0)
        assert t_cb - t0 < 1.0
        assert isinstance(err, WorkerLostError)
        assert (err.worker, err.last_op) == ("worker-0", "aten.mm.default")
        assert err.host and "worker-0" in str(err) and "aten.mm.default" in str(err)
        with pytest.raises(WorkerLostError, match="worker-0"):
            mon.check()
        assert len(lost.calls) == 1


def test_sigstopped_worker_is_lost_within_death_timeout(procs: list[subprocess.Popen[str]]) -> None:
    lost = Recorder()
    with HeartbeatMonitor(interval_s=0.05, death_timeout_s=0.5, on_lost=lost) as mon:
        assert mon.address is not None
        procs.append(spawn_worker(mon.address, "worker-1"))
        _ready(procs[0])
        mon.wait_for_workers(["worker-1"], timeout_s=10)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGSTOP)
        t_cb, err = lost.wait(timeout=3.0)
        assert 0.3 < t_cb - t0 < 0.5 + 0.3
        assert err.worker == "worker-1" and "no heartbeat" in err.reason
        with pytest.raises(WorkerLostError, match="worker-1"):
            mon.check()


def test_busy_main_thread_still_heartbeats(procs: list[subprocess.Popen[str]]) -> None:
    with HeartbeatMonitor(interval_s=0.05, death_timeout_s=0.4) as mon:
        assert mon.address is not None
        procs.append(spawn_worker(mon.address, "worker-2", mode="busy"))
        _ready(procs[0])
        mon.wait_for_workers(["worker-2"], timeout_s=10)
        _wait_until(lambda: mon.workers()["worker-2"].busy_op == "aten.mm.default", timeout=2.0)
        assert procs[0].stdout is not None
        assert procs[0].stdout.readline().strip() == "done"  # 1 s of sleep + 1 s of pure-Python spinning
        time.sleep(0.2)
        mon.check()  # neither lost nor hung
        status = mon.workers()["worker-2"]
        assert status.busy_op is None and status.last_op == "aten.mm.default" and not status.lost


def test_hang_timeout_names_worker_and_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_HANG_TIMEOUT, "0.3")
    hung = Recorder()
    lost = Recorder()
    with HeartbeatMonitor(interval_s=0.05, on_hang=hung, on_lost=lost) as mon:
        assert mon.hang_timeout_s == 0.3 and mon.address is not None
        with HeartbeatClient(
            mon.address, "worker-3", interval_s=0.05, on_controller_lost=lambda r: None
        ) as c:
            mon.wait_for_workers(["worker-3"], timeout_s=5)
            c.set_state("aten.quick")
            time.sleep(0.1)
            c.set_state("aten._scaled_dot_product_flash_attention")
            _, err = hung.wait(timeout=2.0)
            assert isinstance(err, WorkerHangError) and isinstance(err, TimeoutError)
            assert (err.worker, err.op) == ("worker-3", "aten._scaled_dot_product_flash_attention")
            assert ENV_HANG_TIMEOUT in str(err)
            with pytest.raises(WorkerHangError, match="worker-3"):
                mon.check()
            c.set_state(None)
            time.sleep(0.2)
            assert len(hung.calls) == 1 and not lost.calls


def test_graceful_client_stop_is_not_a_death() -> None:
    lost = Recorder()
    with HeartbeatMonitor(interval_s=0.05, death_timeout_s=0.2, on_lost=lost) as mon:
        assert mon.address is not None
        client = HeartbeatClient(mon.address, "worker-4", interval_s=0.05, on_controller_lost=Recorder())
        client.start()
        mon.wait_for_workers(["worker-4"], timeout_s=5)
        client.stop()
        time.sleep(0.5)
        mon.check()
        assert not lost.calls and mon.workers()["worker-4"].left


def test_death_timeout_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DEATH_TIMEOUT, "0.25")
    mon = HeartbeatMonitor()
    assert mon.death_timeout_s == 0.25 and mon.hang_timeout_s > 0


def test_controller_stop_fires_client_callback_within_2s() -> None:
    lost = Recorder()
    mon = HeartbeatMonitor(interval_s=0.05)
    addr = mon.start()
    client = HeartbeatClient(addr, "worker-5", interval_s=0.05, on_controller_lost=lost).start()
    try:
        mon.wait_for_workers(["worker-5"], timeout_s=5)
        t0 = time.monotonic()
        mon.stop()  # abrupt: every stream is cancelled
        t_cb, reason = lost.wait(timeout=3.0)
        assert t_cb - t0 < 2.0 and "controller" in reason
    finally:
        client.stop()


class _SilentServicer(pb_grpc.HeartbeatServicer):  # type: ignore[misc]
    """A controller that accepts the stream but never beats back (frozen, or a partition one way)."""

    def Beat(self, request_iterator: Iterator[pb.Beat], context: Any) -> Iterator[pb.Beat]:  # noqa: N802
        for _ in request_iterator:
            pass
        yield from ()


def test_silent_controller_fires_client_callback_after_controller_timeout() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_HeartbeatServicer_to_server(_SilentServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    lost = Recorder()
    client = HeartbeatClient(
        f"127.0.0.1:{port}", "worker-6", interval_s=0.05, controller_timeout_s=0.5, on_controller_lost=lost
    )
    try:
        t0 = time.monotonic()
        client.start()
        t_cb, reason = lost.wait(timeout=3.0)
        assert 0.4 < t_cb - t0 < 1.5 and "no controller heartbeat" in reason
    finally:
        client.stop()
        server.stop(None).wait(5)


def test_unreachable_controller_raises() -> None:
    with pytest.raises(ControllerUnreachableError, match="worker-7"):
        HeartbeatClient("127.0.0.1:1", "worker-7", connect_timeout_s=0.3).start()


def test_orphan_worker_process_exits_by_itself_within_2s(procs: list[subprocess.Popen[str]]) -> None:
    mon = HeartbeatMonitor(interval_s=0.05)
    addr = mon.start()
    try:
        procs.append(spawn_worker(addr, "worker-8"))
        _ready(procs[0])
        mon.wait_for_workers(["worker-8"], timeout_s=10)
    finally:
        t0 = time.monotonic()
        mon.stop()
    rc = procs[0].wait(timeout=5)
    assert time.monotonic() - t0 < 2.0
    assert rc == CONTROLLER_LOST_EXIT_CODE


def test_a_stalled_watchdog_does_not_count_its_own_stall_as_worker_silence() -> None:
    # the CI box (2 cores, 2 test processes, their workers) can deschedule the controller for over a second; the
    # beats sent meanwhile sit unread in the socket, so that stall is no evidence against the worker
    from torch_dtorch.cluster.heartbeat._common import stall_seconds
    from torch_dtorch.cluster.heartbeat.monitor import WorkerStatus

    assert stall_seconds(0.06, period=0.05) == 0.0
    assert stall_seconds(2.05, period=0.05) == pytest.approx(2.0)
    lost = Recorder()
    mon = HeartbeatMonitor(death_timeout_s=1.0, on_lost=lost)
    mon._workers["w"] = WorkerStatus(worker="w", host="h", pid=1, sequence=1, last_beat=100.0)
    mon._scan(101.9, stalled_s=1.85)  # the watchdog ran last at 100.05, the worker's last beat at 100.0
    assert not lost.calls and not mon.errors()
    mon._scan(102.5)  # a pass on time: 2.5 s of wall time, 0.65 s of it while the watchdog could look
    assert not lost.calls
    mon._scan(103.1)  # silent for 1.25 s of watched time: lost
    ((_, err),) = lost.calls
    assert isinstance(err, WorkerLostError) and err.worker == "w"
