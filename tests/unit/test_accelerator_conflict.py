"""``import torch_dtorch`` makes the dtorch PrivateUse1 device torch's accelerator; torch's autograd engine then asserts
on a backward over plain CUDA tensors (pytorch/pytorch#161129, seen on the H100/H200 with torch 2.11). That assert
becomes an :class:`AcceleratorConflictError` naming the cause and the fix; other errors pass unchanged. The real
assert needs CUDA: a backward that raises the same message stands in for it here."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch  # noqa: F401 - registers the device (and the wrapper)
from torch_dtorch.errors import AcceleratorConflictError


class _Raises(torch.autograd.Function):
    message = ""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(_Raises.message)


def _backward(message: str) -> None:
    _Raises.message = message
    x = torch.ones(3, requires_grad=True)
    _Raises.apply(x).sum().backward()


def test_engine_stream_assert_is_explained() -> None:
    with pytest.raises(
        AcceleratorConflictError, match=r"current_accelerator\(\) is dtorch.*161129.*Fix: put the model"
    ):
        _backward('opt_ready_stream && opt_parent_stream INTERNAL ASSERT FAILED at "engine.cpp":1084')
    x = torch.ones(2, requires_grad=True)
    _Raises.message = "opt_ready_stream && opt_parent_stream"
    with pytest.raises(AcceleratorConflictError):  # torch.autograd.grad takes the same path
        torch.autograd.grad(_Raises.apply(x).sum(), x)


def test_other_errors_pass_unchanged() -> None:
    with pytest.raises(RuntimeError, match="^something else$") as info:
        _backward("something else")
    assert not isinstance(info.value, AcceleratorConflictError)


_BACKWARD_BEFORE_IMPORT = """
import logging, torch
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
x = torch.ones(3, requires_grad=True)
(x * 2).sum().backward()  # the engine starts its device threads now, before the dtorch device exists
import torch_dtorch as dt
mesh = dt.init_device_mesh("cpu", (2,))
w = dt.distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh).requires_grad_()
for _ in range(2):  # the second backward takes the calling-thread path at once
    (w * w).sum().backward()
print("grad", dt.to_torch(w.grad).tolist())
"""


def test_backward_before_import_runs_on_the_calling_thread() -> None:
    """A backward before ``import torch_dtorch`` sized the engine's device queues without the dtorch device; dtorch's
    backward then failed torch's INTERNAL ASSERT ``device_ready_queues_``. It now runs on the calling thread (with a
    warning that says why), and the gradients are right."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _BACKWARD_BEFORE_IMPORT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = (2 * 2 * torch.arange(6.0).reshape(2, 3)).tolist()  # two backward passes accumulate 2w each
    assert f"grad {expected}" in proc.stdout
    assert "started its device threads before torch_dtorch was imported" in proc.stderr
