"""The per-call key memo of compiled graphs (``backend/call_key.py``): after any change of the inputs it gives
exactly what deriving the key input by input gives, and a compiled model sees parameters rebound by ``copy_``."""

from __future__ import annotations

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.backend import dtorch_backend
from torch_dtorch.backend.call_key import CallKeyMemo, fast_key
from torch_dtorch.device.state import get_session


def test_memo_matches_fast_key_as_inputs_change() -> None:
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    gen = get_session().generation
    params = [dt.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]) for _ in range(5)]
    memo = CallKeyMemo()

    def check(args: list[object]) -> None:
        assert memo.key(gen, args) == fast_key(gen, args)

    x = dt.distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
    assert fast_key(gen, [x, *params]) is not None  # live bound tensors always have a key (the hot path)
    check([x, *params])
    check([x, *params])  # unchanged: the remembered key
    y = dt.distribute_tensor(torch.randn(4, 3), mesh, [Shard(1)])
    check([y, *params])  # one new input with another layout
    params[2].copy_(torch.randn(4, 3))  # rebinds the storage to a new operand
    check([y, *params])
    params[3] = params[3].redistribute(mesh, [Replicate()])
    check([y, *params])
    check([y, *params[:-1]])  # fewer inputs
    check([y, *params[:-1], 3])  # not a tensor: no fast key
    assert memo.key(gen, [y, 3]) is None and fast_key(gen, [y, 3]) is None
    del x
    check([y, *params])


def test_compiled_model_sees_parameters_rebound_between_calls() -> None:
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4)
    ref = torch.nn.Linear(6, 4)
    ref.load_state_dict(lin.state_dict())
    for name, p in list(lin.named_parameters()):
        setattr(lin, name, torch.nn.Parameter(dt.distribute_tensor(p.detach(), mesh, [Shard(0)])))
    compiled = torch.compile(lin, backend=dtorch_backend)
    x = torch.randn(5, 6)
    dx = dt.distribute_tensor(x, mesh, [Replicate()])
    with torch.no_grad():
        for step in range(3):
            torch.testing.assert_close(compiled(dx).full_tensor(), ref(x))
            new = torch.randn(4, 6)
            ref.weight.copy_(new)
            lin.weight.copy_(dt.distribute_tensor(new, mesh, [Shard(0)]))  # the same Parameter object
            torch.testing.assert_close(compiled(dx).full_tensor(), ref(x), msg=f"step {step}")
