"""MemoryTensorStore: put/get/pop/delete, waiting, timeouts, close, keys."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torch_dtorch.collectives import MemoryTensorStore, TensorStore, TensorStoreError, TensorStoreTimeout


def test_put_get_pop_delete() -> None:
    store = MemoryTensorStore(timeout_s=1)
    x = torch.arange(3)
    store.put((1, 0), x)
    assert (1, 0) in store and len(store) == 1
    assert store.get((1, 0)) is x  # no copy in memory
    assert store.pop((1, 0)) is x
    assert (1, 0) not in store
    store.put("barrier/7", torch.empty(0))
    assert store.delete("barrier/7") and not store.delete("barrier/7")


def test_duplicate_keys_and_bad_keys_raise() -> None:
    store = MemoryTensorStore()
    store.put((3, 1), torch.ones(1))
    with pytest.raises(TensorStoreError, match="already holds"):
        store.put((3, 1), torch.ones(1))
    for bad in [(1,), (1, -2), (1.0, 2), "", (True, 1), 5]:
        with pytest.raises(TensorStoreError, match="key"):
            store.put(bad, torch.ones(1))  # type: ignore[arg-type]


def test_get_waits_for_a_later_put() -> None:
    store = MemoryTensorStore()
    threading.Timer(0.05, store.put, args=((9, 2), torch.full((2,), 4.0))).start()
    start = time.monotonic()
    assert torch.equal(store.pop((9, 2), timeout=5), torch.full((2,), 4.0))
    assert time.monotonic() - start < 2


def test_timeouts() -> None:
    store = MemoryTensorStore(timeout_s=0.05)
    with pytest.raises(TensorStoreTimeout, match=r"\(4, 0\)"):
        store.get((4, 0))
    with pytest.raises(TimeoutError):  # callers may catch the builtin
        store.pop((4, 0), 0.01)
    with pytest.raises(TensorStoreTimeout):
        store.get((4, 0), 0)


def test_timeout_default_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTORCH_COLLECTIVE_TIMEOUT_S", "12.5")
    assert MemoryTensorStore().timeout_s == 12.5


def test_close_wakes_waiters() -> None:
    store = MemoryTensorStore(timeout_s=10)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            store.get((1, 1))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    with store:
        pass  # __exit__ closes
    t.join(2)
    assert not t.is_alive() and isinstance(errors[0], TensorStoreError) and "closed" in str(errors[0])
    with pytest.raises(TensorStoreError, match="closed"):
        store.put((1, 1), torch.ones(1))


def test_key_str_is_canonical_and_file_safe() -> None:
    assert TensorStore.key_str((12, 3)) == "r12-d3"
    assert TensorStore.key_str("fetch/a b") == "s-fetch%2fa%20b"
    with pytest.raises(TensorStoreError):
        TensorStore.key_str((1, 2, 3))  # type: ignore[arg-type]


def test_many_threads() -> None:
    store = MemoryTensorStore(timeout_s=10)

    def producer(i: int) -> None:
        for k in range(50):
            store.put((k, i), torch.tensor([k * 10 + i]))

    out: dict[tuple[int, int], int] = {}

    def consumer(i: int) -> None:
        for k in range(50):
            out[(k, i)] = int(store.pop((k, i)))

    threads = [threading.Thread(target=f, args=(i,)) for i in range(4) for f in (consumer, producer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(out) == 200 and all(v == k * 10 + i for (k, i), v in out.items()) and len(store) == 0
