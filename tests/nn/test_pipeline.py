"""Pipeline stages: layer assignment, activations moved between stage meshes, and micro-batches that overlap
(shown with slow kernels injected through the runtime's kernel hooks)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import torch_dtorch as dt
from tests.nn.conftest import init_mesh
from torch_dtorch.executor.instructions import RunOp
from torch_dtorch.nn.pipeline import assign_layers_to_stages, pipeline_forward, pipeline_parallel
from torch_dtorch.runtime import op_runner as kernel_mod


def test_assign_layers_to_stages() -> None:
    assert assign_layers_to_stages(5, 2) == [0, 0, 0, 1, 1]
    assert assign_layers_to_stages(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="num_stages <= num_layers"):
        assign_layers_to_stages(2, 3)


class Chain(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_microbatches_overlap_stages() -> None:
    """2 stages, 4 micro-batches, each linear slowed to DELAY on its worker: run one after the other it takes
    8 * DELAY; pipelined about 5 * DELAY."""
    delay = 0.15
    torch.manual_seed(0)
    ref = Chain(2).eval()
    model = Chain(2).eval()
    model.load_state_dict(ref.state_dict())
    mesh = init_mesh((2,), mesh_dim_names=("pp",))
    stages = pipeline_parallel(model, mesh)
    assert [m.devices for m in stages.meshes] == [[0], [1]]
    x = torch.randn(8, 8)

    def slow(instr: object, device: int) -> None:
        if isinstance(instr, RunOp) and "linear" in str(instr.node.op):
            time.sleep(delay)

    kernel_mod.before_hooks.append(slow)
    try:
        with torch.no_grad():
            start = time.perf_counter()
            out = pipeline_forward(model, x, num_microbatches=4, mesh=stages.meshes[0]).full_tensor()
            elapsed = time.perf_counter() - start
    finally:
        kernel_mod.before_hooks.remove(slow)
    with torch.no_grad():
        torch.testing.assert_close(out, ref(x))
    assert elapsed < 6.5 * delay, (
        f"{elapsed:.2f}s: stages did not overlap (sequential would be {8 * delay:.2f}s)"
    )


def test_activation_moves_between_stage_meshes() -> None:
    torch.manual_seed(0)
    ref = Chain(3).eval()
    model = Chain(3).eval()
    model.load_state_dict(ref.state_dict())
    mesh = init_mesh((3, 2), mesh_dim_names=("pp", "dp"))
    stages = pipeline_parallel(model, mesh)
    assert [model.layers[i].weight.device_mesh.devices for i in range(3)] == [[0, 1], [2, 3], [4, 5]]
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = model(dt.distribute_tensor(x, stages.meshes[0], [dt.Shard(0)]))
        assert y.device_mesh == stages.meshes[2] and y.placements == (dt.Shard(0),)
        torch.testing.assert_close(y.full_tensor(), ref(x))


class Body(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


class WithHead(nn.Module):
    """A ``ForCausalLM``-shaped model: the layer list sits under a container (``body.layers``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.body = Body(n)
        self.head = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x * self.scale))  # own parameters are used before the first stage


def test_nested_layer_list() -> None:
    """``layers="body.layers"``: the modules beside the list on its path are stage units (``body.embed`` first,
    ``body.norm`` and ``head`` last, by path or by own name); the model's own parameter stays on stage 0."""
    torch.manual_seed(0)
    ref = WithHead(3).eval()
    model = WithHead(3).eval()
    model.load_state_dict(ref.state_dict())
    mesh = init_mesh((2,), mesh_dim_names=("pp",))
    stages = pipeline_parallel(model, mesh, layers="body.layers", last_stage=("norm", "head"))
    assert stages.layer_stage == [0, 0, 1]
    assert stages.owners == {
        "body.layers.0": 0, "body.layers.1": 0, "body.layers.2": 1, "head": 1, "body.embed": 0, "body.norm": 1,
    }  # fmt: skip
    assert model.body.embed.weight.device_mesh == stages.meshes[0]
    assert model.body.norm.weight.device_mesh == stages.meshes[1]
    assert model.head.weight.device_mesh == stages.meshes[1]
    assert model.scale.device_mesh == stages.meshes[0]
    x = torch.randn(4, 8)
    with torch.no_grad():
        y = model(dt.distribute_tensor(x, stages.meshes[0], [dt.Replicate()]))
        torch.testing.assert_close(y.full_tensor(), ref(x))
