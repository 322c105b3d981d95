"""``DTORCH_VALIDATE_KERNEL_IO=1``: a deliberate shape bug in a rule's local kernel is caught on the worker with
a message naming the op, the rank and both shapes (without validation it would surface later, or not at all)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import thread_only
from tests.tools.conftest import init_mesh
from torch_dtorch.device.state import get_session
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.runtime import KernelIOError

aten = torch.ops.aten


@thread_only
@pytest.mark.parametrize("validate", [True, False])
def test_wrong_local_shape_is_named(monkeypatch: pytest.MonkeyPatch, validate: bool) -> None:
    mesh = init_mesh((2,))
    rule = get_rule(aten.tanh.default)
    original = rule.kernel

    def kernel(call: Any, ctx: Any, args: Any, kwargs: Any) -> Any:
        out = original(call, ctx, args, kwargs)
        return out[:, :-1] if ctx.device == 1 else out  # a buggy rule: drops a column on rank 1

    monkeypatch.setattr(rule, "kernel", kernel)
    for w in get_session().executor.runner.workers.values():
        monkeypatch.setattr(w.op_runner, "validate", validate)
    x = dt.distribute_tensor(torch.randn(4, 6), mesh, [dt.Shard(0)])
    y = torch.tanh(x)
    if not validate:
        # the local [2, 5] shard goes unnoticed by the kernel; only the assembled value is wrong
        with pytest.raises(Exception) as info:
            y.full_tensor()
        assert not isinstance(info.value, KernelIOError)
        return
    with pytest.raises(KernelIOError) as err:
        y.full_tensor()
    msg = str(err.value)
    assert "aten.tanh failed on worker 1" in msg, msg
    assert "rank (1,)" in msg and "shape [2, 5], expected [2, 6]" in msg, msg
    assert err.value.op == "aten.tanh" and err.value.device == 1
