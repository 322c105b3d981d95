"""The native extensions' build lock: a build killed mid-way (Ctrl-C, a timeout) left torch's file lock behind, and
every later process waited on it forever; now a waiter gives up on a lock older than the stale limit."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import pytest

from torch_dtorch import _native_build


def test_stale_lock_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - _native_build._STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=_native_build.__name__):
        _native_build.wait_for_build_lock(lock, what="the test extension")
    assert not lock.exists()
    assert "killed" in caplog.text


def test_waits_for_a_live_build_then_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_native_build, "_LOCK_POLL_S", 0.01)
    lock = tmp_path / "lock"
    lock.touch()
    timer = threading.Timer(0.2, lock.unlink)  # the other build finishes
    timer.start()
    t0 = time.perf_counter()
    _native_build.wait_for_build_lock(lock, what="the test extension")
    assert time.perf_counter() - t0 >= 0.15
    timer.join()


def test_a_fresh_lock_that_never_goes_is_stale_in_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_native_build, "_LOCK_POLL_S", 0.01)
    monkeypatch.setattr(_native_build, "_STALE_LOCK_S", 0.2)
    lock = tmp_path / "lock"
    lock.touch()
    t0 = time.perf_counter()
    _native_build.wait_for_build_lock(lock, what="the test extension")  # returns instead of hanging
    assert not lock.exists()
    assert time.perf_counter() - t0 < 5
