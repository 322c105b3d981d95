"""Stale socket directories of dead controllers (issue 18 e) and the bounded reject log (issue 18 d)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from torch_dtorch.cluster.transport.rejects import RejectLog
from torch_dtorch.cluster.transport.tempdirs import (
    cleanup_stale_dirs,
    owner_pid,
    pid_alive,
    private_dir,
    remove_if_orphaned,
    remove_store_if_orphaned,
)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_private_dir_is_named_after_its_owner() -> None:
    d = private_dir("sock")
    try:
        assert owner_pid(d) == os.getpid() and oct(os.stat(d).st_mode & 0o777) == "0o700"
    finally:
        os.rmdir(d)
    with pytest.raises(ValueError, match="kind must be"):
        private_dir("other")


def test_cleanup_removes_only_directories_of_dead_owners(tmp_path: Path) -> None:
    dead = _dead_pid()
    assert not pid_alive(dead) and pid_alive(os.getpid())
    stale = [tmp_path / f"dtorch-cluster-{dead}-ab12", tmp_path / f"dtorch-sock-{dead}-x_y9"]
    kept = [
        tmp_path / f"dtorch-sock-{os.getpid()}-live1",  # owner alive
        tmp_path / "dtorch-3233m27d",  # old name: owner unknown
        tmp_path / f"other-sock-{dead}-zz",
    ]
    for d in stale + kept:
        d.mkdir()
        (d / "pub.sock").write_text("")
    (tmp_path / f"dtorch-sock-{dead}-file").write_text("")  # not a directory
    removed = cleanup_stale_dirs(tmp_path)
    assert sorted(removed) == sorted(str(d) for d in stale)
    assert all(d.exists() for d in kept) and (tmp_path / f"dtorch-sock-{dead}-file").exists()


def test_a_worker_removes_its_dead_controllers_directories(tmp_path: Path) -> None:
    dead = _dead_pid()
    sock = tmp_path / f"dtorch-cluster-{dead}-q1"
    store = tmp_path / f"dtorch-store-{dead}-0a1b2c"
    live = tmp_path / f"dtorch-cluster-{os.getpid()}-q2"
    for d in (sock, store, live):
        d.mkdir()
    assert not remove_if_orphaned(f"tcp://127.0.0.1:5/{sock.name}")
    assert not remove_if_orphaned(f"ipc://{live}/control.sock") and live.exists()
    assert remove_if_orphaned(f"ipc://{sock}/control.sock") and not sock.exists()
    assert remove_store_if_orphaned(store) and not store.exists()


def test_reject_log_counts_everything_keeps_little_and_logs_rarely(caplog: pytest.LogCaptureFixture) -> None:
    rl = RejectLog(logging.getLogger("test.rejects"), "tester", keep=8, interval_s=3600.0)
    with caplog.at_level(logging.WARNING, logger="test.rejects"):
        assert rl.add("first bad one", kind="AuthenticationError") == 1
        tracemalloc.start()
        try:
            for i in range(200):  # warm-up
                rl.add(f"bad message {i} " + "x" * 100, kind="AuthenticationError")
            base = tracemalloc.get_traced_memory()[0]
            for i in range(20000):
                rl.add(f"bad message {i} " + "x" * 100, kind="ProtocolError")
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
    assert grown < 20_000, grown
    assert len(rl) == rl.count == 20201 and rl.by_type["ProtocolError"] == 20000
    assert len(rl.recent) == 8 and rl.recent[-1].startswith("bad message 19999")
    assert len(caplog.records) == 1  # the first only: the rest wait for the interval
    assert rl.since(20199) == [t for t in rl.recent][-2:]
    pending = rl.take_pending(force=True)
    assert pending is not None and pending[0] == 20200 and pending[1].startswith("bad message 19999")
    assert len(caplog.records) == 2 and "20200 more" in caplog.records[-1].getMessage()
    assert rl.take_pending(force=True) is None
