"""A training step on worker processes (cluster mode): backward rules, the differentiable redistribute and the
optimizer run the same there as on threads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.models import TinyLM, assert_grads_close, assert_params_close, twin
from torch_dtorch import Replicate

pytestmark = pytest.mark.slow  # starts worker processes (seconds on 2 cores)


@pytest.fixture(scope="module")
def mesh() -> Iterator[dt.DeviceMesh]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "10")  # a loaded 2-core CI machine can miss the 1 s default
    dt.shutdown()  # a thread pool of an earlier module
    try:
        yield dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",), mode="process")
    finally:
        dt.shutdown()
        mp.undo()


def test_tiny_lm_training_steps_on_processes(mesh: dt.DeviceMesh) -> None:
    from torch_dtorch.device.state import get_session

    assert get_session().mode == "process"
    torch.manual_seed(0)
    ref = TinyLM()
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    model = dt.parallelize_module(twin(ref), mesh, plan)
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, foreach=True)
    for _ in range(2):
        ids, targets = torch.randint(0, 11, (3, 4)), torch.randint(0, 11, (3, 4))
        for m, o, inp, tgt in ((model, opt, dt.distribute_tensor(ids, mesh), dt.distribute_tensor(targets, mesh)),
                               (ref, ref_opt, ids, targets)):  # fmt: skip
            o.zero_grad()
            F.cross_entropy(m(inp).flatten(0, 1), tgt.flatten()).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
    assert_params_close(model, ref)


def test_layer_norm_backward_on_processes(mesh: dt.DeviceMesh) -> None:
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(6)
    ref = twin(ln)
    dt.match_grad_placements(dt.parallelize_module(ln, mesh, {}))
    x = torch.randn(5, 6)
    ln(dt.distribute_tensor(x, mesh, [dt.Shard(0)])).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert_grads_close(ln.named_parameters(), ref.named_parameters())


def test_sharded_checkpoint_on_processes(mesh: dt.DeviceMesh, tmp_path: Path) -> None:
    """Worker processes write and read their own blocks."""
    value = torch.randn(5, 4)
    dt.checkpoint.save({"w": dt.distribute_tensor(value, mesh, [dt.Shard(0)])}, checkpoint_id=tmp_path)
    assert sorted(p.name for p in tmp_path.glob("shard-*")) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    w = dt.distribute_tensor(torch.zeros(5, 4), mesh, [dt.Shard(1)])
    dt.checkpoint.load({"w": w}, checkpoint_id=tmp_path)
    torch.testing.assert_close(w.full_tensor(), value)
