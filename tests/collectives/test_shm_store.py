"""ShmTensorStore: bit-exact round trips, waiting and timeouts, two processes sharing one directory, cleanup."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from torch_dtorch.collectives.errors import TensorStoreError, TensorStoreTimeout
from torch_dtorch.collectives.shm_store import RemoteError, ShmTensorStore, cleanup_stale

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store() -> Iterator[ShmTensorStore]:
    s = ShmTensorStore(timeout_s=5)
    yield s
    s.close()


def _bits(t: torch.Tensor) -> bytes:
    t = t.resolve_conj().resolve_neg().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _values() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = [
        torch.randn(3, 5, generator=g),
        torch.randn(4, dtype=torch.float64, generator=g),
        torch.randn(2, 3, generator=g).to(torch.float16),
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.tensor([float("nan"), -0.0, float("inf")]),
        torch.randint(-100, 100, (7,), dtype=torch.int8, generator=g),
        torch.randint(-(2**15), 2**15 - 1, (3,), dtype=torch.int16, generator=g),
        torch.randint(-(2**31), 2**31 - 1, (3,), dtype=torch.int32, generator=g),
        torch.tensor([-(2**63), 2**63 - 1, 5]),
        torch.randint(0, 255, (2, 2), dtype=torch.uint8, generator=g),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64, generator=g),
        torch.randn(2, 2, dtype=torch.complex128, generator=g),
        torch.tensor(3.5),  # 0-d
        torch.tensor(7, dtype=torch.int64),
        torch.empty(0, 4),  # empty
        torch.empty(2, 0, dtype=torch.bfloat16),
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous
        torch.randn(3, dtype=torch.complex64, generator=g).conj(),  # conjugate view
    ]
    return out


def test_bit_exact_round_trips(store: ShmTensorStore) -> None:
    for i, t in enumerate(_values()):
        store.put((i, 0), t)
        got = store.get((i, 0))
        assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous(), t
        assert _bits(got) == _bits(t), t
        assert _bits(store.pop((i, 0))) == _bits(t)
        assert (i, 0) not in store


def test_put_get_pop_delete_and_timeouts(store: ShmTensorStore) -> None:
    store.put("barrier/7", torch.empty(0))
    assert "barrier/7" in store
    with pytest.raises(TensorStoreError, match="already holds"):
        store.put("barrier/7", torch.ones(1))
    assert store.delete("barrier/7") and not store.delete("barrier/7")
    t0 = time.monotonic()
    with pytest.raises(TensorStoreTimeout, match=r"no value under \(1, 2\) after 0.05 s"):
        store.pop((1, 2), timeout=0.05)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TensorStoreError, match="keys are"):
        store.put((-1, 0), torch.ones(1))
    with pytest.raises(TensorStoreError, match="values are tensors"):
        store.put((1, 1), [1, 2])  # type: ignore[arg-type]


def test_waiting_get_sees_a_later_put(store: ShmTensorStore) -> None:
    threading.Timer(0.05, lambda: store.put((4, 1), torch.full((2,), 4.0))).start()
    assert torch.equal(store.pop((4, 1), timeout=5), torch.full((2,), 4.0))


def test_exceptions_travel_as_remote_errors(store: ShmTensorStore) -> None:
    store.put((9, 0), ValueError("shard 3 is poisoned"))  # type: ignore[arg-type]
    err = store.pop((9, 0))
    assert isinstance(err, RemoteError) and err.type_name == "builtins.ValueError"
    assert "shard 3 is poisoned" in str(err)


def test_directory_is_private_and_removed_on_close() -> None:
    s = ShmTensorStore()
    path = s.path
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    for i in range(5):
        s.put((i, 0), torch.ones(3))
    s.pop((0, 0))
    assert sorted(p.name for p in path.iterdir()) == [f"r{i}-d0" for i in range(1, 5)]  # no temp files left
    waiter_error: list[BaseException] = []

    def wait() -> None:
        try:
            s.get("never", timeout=10)
        except BaseException as e:  # noqa: BLE001
            waiter_error.append(e)

    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.05)
    s.close()
    th.join(5)
    assert not path.exists()
    assert waiter_error and isinstance(waiter_error[0], TensorStoreError)
    s.close()  # idempotent
    with pytest.raises(TensorStoreError, match="closed"):
        s.put((0, 0), torch.ones(1))


def test_attached_store_does_not_remove_the_directory(store: ShmTensorStore) -> None:
    other = ShmTensorStore(store.path)
    other.put((1, 0), torch.ones(2))
    other.close()
    assert store.path.is_dir() and torch.equal(store.pop((1, 0)), torch.ones(2))
    with pytest.raises(FileNotFoundError):
        ShmTensorStore(store.path / "missing")


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from torch_dtorch.collectives.shm_store import ShmTensorStore
    s = ShmTensorStore(sys.argv[1], timeout_s=30)
    x = s.pop((1, 0))
    s.put((2, 0), (x * 2).to(torch.bfloat16))
    s.put((3, 0), torch.tensor([True, False]))
    s.put((4, 0), RuntimeError("boom"))
    s.close()
    """
)


@pytest.mark.slow
def test_two_processes_exchange_tensors(store: ShmTensorStore) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(store.path)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
    )
    try:
        x = torch.randn(64, 33)
        store.put((1, 0), x)
        y = store.pop((2, 0), timeout=60)
        assert y.dtype == torch.bfloat16 and torch.equal(y, (x * 2).to(torch.bfloat16))
        assert torch.equal(store.pop((3, 0), timeout=60), torch.tensor([True, False]))
        err = store.pop((4, 0), timeout=60)
        assert isinstance(err, RemoteError) and err.type_name == "builtins.RuntimeError"
        _, stderr = child.communicate(timeout=60)
        assert child.returncode == 0, stderr.decode()
    finally:
        if child.poll() is None:
            child.kill()
    assert store.path.is_dir()  # the child attached; only the owner removes the directory
    store.close()
    assert not store.path.exists()


def test_cleanup_stale_removes_only_dead_owners(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"dtorch-test-{dead_pid}-abc123"
    stale.mkdir(mode=0o700)
    (stale / "r1-d0").write_bytes(b"x")
    live = ShmTensorStore(base=tmp_path, prefix="dtorch-test")
    other = tmp_path / "unrelated-1-x"
    other.mkdir()
    try:
        removed = cleanup_stale("dtorch-test", base=tmp_path)
        assert removed == [stale] and not stale.exists()
        assert live.path.is_dir() and other.is_dir()
    finally:
        live.close()
    assert not live.path.exists()


def test_large_values_are_mapped_copy_on_write(store: ShmTensorStore) -> None:
    big = torch.randn(256, 129)  # > 64 KiB: mapped, not copied; odd row length: the data offset stays aligned
    store.put("big", big)
    got = store.get("big")
    got.mul_(0)  # a private mapping: the stored value does not change
    again = store.pop("big")
    assert torch.equal(again, big) and not got.any()
    assert os.listdir(store.path) == []  # the file is gone; the tensor keeps its pages
    assert torch.equal(again * 1, big)
