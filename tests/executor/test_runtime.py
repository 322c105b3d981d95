"""Layer 2 pieces on their own: Blob, KernelError, KernelStream, PoisonBoard."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from tests.executor.conftest import MakeExecutor
from torch_dtorch.placement import Shard
from torch_dtorch.runtime import Blob, KernelError, KernelIOError, KernelStream
from torch_dtorch.runtime import op_runner as kernel_module
from torch_dtorch.runtime.sticky import PoisonBoard

aten = torch.ops.aten


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


def _torch_function_state() -> tuple[bool, list[str], str]:
    """This thread's torch function modes (``torch.set_default_device`` installs a ``DeviceContext``)."""
    modes = [type(m).__name__ for m in _get_current_function_mode_stack()]
    return torch._C._is_torch_function_mode_enabled(), modes, torch.get_default_device().type


def test_kernel_stream_sets_no_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker thread has no default device: its TorchFunctionMode would tax every torch call made from Python.
    Without a GPU the stream's CUDA calls are faked, so its CUDA path runs too."""
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
    seen: dict[str, tuple[bool, list[str], str]] = {}
    for device in ("cpu", "cuda:0"):
        s = KernelStream(device, name="test-stream")
        s.submit(lambda device=device: seen.setdefault(device, _torch_function_state()))
        assert s.wait_idle(5.0) and s.close(timeout=5.0)
    assert seen == {"cpu": (False, [], "cpu"), "cuda:0": (False, [], "cpu")}


def test_kernels_run_without_torch_function_modes(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex, mesh = make_executor((2,))
    seen: list[tuple[bool, list[str], str]] = []
    run_rank = kernel_module.run_rank

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(_torch_function_state())
        return run_rank(*args, **kwargs)

    monkeypatch.setattr(kernel_module, "run_rank", spy)
    x = ex.input((4,), mesh, [Shard(0)])
    ex.upload(x, torch.arange(4.0))
    y = ex.call(aten.mul.Tensor, x, x)
    assert torch.equal(ex.fetch(y).get(timeout=30), torch.arange(4.0) ** 2)
    assert seen == [(False, [], "cpu")] * 2


def test_poison_board_capacity() -> None:
    board = PoisonBoard(capacity=3)
    errs = [KernelError("op", i, "x") for i in range(5)]
    for i, e in enumerate(errs):
        board.post(i, e)
    assert board.get(0) is None and board.get(4) is errs[4]
    board.post(4, errs[0])  # first post wins
    assert board.get(4) is errs[4]
