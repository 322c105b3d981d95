"""Layer 2 pieces on their own: Blob, KernelError, KernelStream, PoisonBoard."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from torch_dtorch.runtime import Blob, KernelError, KernelIOError, KernelStream
from torch_dtorch.runtime.kernel import PoisonBoard


def test_blob_holds_a_tensor_or_an_error() -> None:
    b = Blob(torch.zeros(2, 3))
    assert b.ok and "float32[2, 3]" in repr(b)
    e = Blob(error=KernelError("aten.mm", 3, ValueError("bad")))
    assert not e.ok and "aten.mm" in repr(e)
    with pytest.raises(ValueError):
        Blob()
    with pytest.raises(ValueError):
        Blob(torch.zeros(1), error=KernelError("x", 0, "y"))


def test_kernel_error_message_copy_and_pickle() -> None:
    err = KernelIOError("aten.view", 1, "shape [12], expected [2, 6]", call_site="model.py:3 in forward")
    msg = str(err)
    assert "aten.view failed on worker 1" in msg and "model.py:3 in forward" in msg
    again = err.again("fetching %4")
    assert type(again) is KernelIOError and str(again).endswith("while fetching %4")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is KernelIOError and str(back) == msg and back.device == 1


def test_kernel_stream_runs_in_order_and_closes() -> None:
    s = KernelStream("cpu", name="test-stream")
    seen: list[int] = []
    names: set[str] = set()
    for i in range(100):
        s.submit(lambda i=i: (seen.append(i), names.add(threading.current_thread().name)))
    assert s.wait_idle(5.0)
    assert seen == list(range(100)) and names == {"test-stream"}
    # a failing closure does not kill the thread
    s.submit(lambda: 1 / 0)
    s.submit(lambda: seen.append(-1))
    assert s.wait_idle(5.0) and seen[-1] == -1
    # close(discard=True) drops what is still queued
    s.submit(lambda: time.sleep(0.2))
    s.submit(lambda: seen.append(-2))
    assert s.close(discard=True, timeout=5.0)
    assert not s.alive and seen[-1] == -1
    assert s.stream("compute") is None  # no CUDA streams on the CPU
    with s.use("comm"):
        pass


def test_poison_board_capacity() -> None:
    board = PoisonBoard(capacity=3)
    errs = [KernelError("op", i, "x") for i in range(5)]
    for i, e in enumerate(errs):
        board.post(i, e)
    assert board.get(0) is None and board.get(4) is errs[4]
    board.post(4, errs[0])  # first post wins
    assert board.get(4) is errs[4]
