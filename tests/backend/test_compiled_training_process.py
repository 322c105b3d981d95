"""Compiled training on worker processes: the forward and backward programs travel as ``ProgramSource``s and
each process builds its own; losses, gradients and parameters equal torch's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.models import MLP, assert_grads_close, assert_params_close, twin
from torch_dtorch import Replicate, Shard

pytestmark = pytest.mark.slow  # starts worker processes


@pytest.fixture(scope="module")
def mesh() -> Iterator[dt.DeviceMesh]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "10")  # a loaded 2-core CI machine can miss the 1 s default
    dt.shutdown()
    try:
        yield dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",), mode="process")
    finally:
        dt.shutdown()
        mp.undo()


def test_tp_mlp_compiled_training_on_processes(mesh: dt.DeviceMesh) -> None:
    from torch_dtorch.device.state import get_session

    assert get_session().mode == "process"
    torch.manual_seed(0)
    ref = MLP()
    model = dt.parallelize_module(
        twin(ref), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    compiled = torch.compile(model, backend="dtorch")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        x, y = torch.randn(6, 6, generator=gen), torch.randn(6, 5, generator=gen)
        dx = dt.distribute_tensor(x, mesh, [Shard(0)])
        dy = dt.distribute_tensor(y, mesh, [Replicate()])
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(compiled(dx), dy)
        loss.backward()
        want = F.mse_loss(ref(x), y)
        want.backward()
        torch.testing.assert_close(loss.detach().full_tensor(), want.detach(), atol=1e-5, rtol=1e-5)
        assert_grads_close(model.named_parameters(), ref.named_parameters())
        opt.step()
        ref_opt.step()
    assert_params_close(model, ref)
