"""Upstream ParallelStyles are translated by reading their attributes; unknown styles and bad plans are refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

import torch_dtorch as dt
import torch_dtorch.nn as dnn
from tests.nn.conftest import init_mesh
from torch_dtorch import Replicate, Shard


def test_translation_reads_attributes() -> None:
    c = dnn.from_upstream(ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    assert isinstance(c, dnn.ColumnParallel) and c.input_layout == Shard(1) and c.output_layout == Replicate()
    r = dnn.from_upstream(RowwiseParallel(output_layouts=Shard(1)))
    assert isinstance(r, dnn.RowParallel) and r.output_layout == Shard(1)
    s = dnn.from_upstream(SequenceParallel(sequence_dim=0))
    assert isinstance(s, dnn.SequenceParallel) and s.sequence_dim == 0
    p = dnn.from_upstream(
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None))
    )
    assert isinstance(p, dnn.PrepareInput) and tuple(p.desired_input_layouts) == (Replicate(), None)
    o = dnn.from_upstream(PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate()))
    assert isinstance(o, dnn.PrepareOutput) and tuple(o.desired_output_layouts) == (Replicate(),)


def test_unknown_style_and_module_refused() -> None:
    class Custom(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh: object) -> nn.Module:
            return module

    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    with pytest.raises(NotImplementedError, match="Custom is not supported"):
        dnn.parallelize_module(nn.Sequential(nn.Linear(2, 2)), mesh, {"0": Custom()})
    with pytest.raises(NotImplementedError, match="ColumnParallel on 0 .ReLU.*nn.Linear and nn.Embedding"):
        dnn.parallelize_module(nn.Sequential(nn.ReLU()), mesh, {"0": ColwiseParallel()})


def test_plan_patterns_layer_classes_and_tied_params() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.Linear(6, 6))
    ref[3].weight = ref[2].weight if ref[2].weight.shape == ref[3].weight.shape else ref[3].weight
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6), nn.Linear(6, 6))
    model.load_state_dict(ref.state_dict())
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    dnn.parallelize_module(
        model, mesh, {"0": dnn.ColumnParallelLinear, "[2]": RowwiseParallel(), "nomatch": ColwiseParallel()}
    )
    assert isinstance(model[0], dnn.ColumnParallelLinear)
    assert model[2].weight.placements == (Shard(1),) and model[3].weight.placements == (Replicate(),)
    x = torch.randn(3, 6)
    with torch.no_grad():
        torch.testing.assert_close(
            model(dt.distribute_tensor(x, mesh)).full_tensor(), ref(x), rtol=1e-5, atol=1e-5
        )


class _TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, y + 1


def test_plain_inputs_declared_sharded_are_local_shards() -> None:
    """As upstream (``DTensor.from_local`` on every rank): a plain tensor declared ``Shard(d)`` is each rank's local
    shard, so the global tensor holds n copies along d; declared ``Replicate`` it is the global value; a dtorch input
    is always global."""
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    m = _TwoInputs()
    style = PrepareModuleInput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Replicate(),),
        input_kwarg_layouts={"y": Replicate()},
        desired_input_kwarg_layouts={"y": Shard(0)},
    )
    dnn.parallelize_module(m, mesh["tp"], {"": style})
    x, y = torch.randn(3, 4), torch.randn(4, 5)
    out_x, out_y = m(x, y=y)
    assert tuple(out_x.shape) == (3, 8) and out_x.placements == (Replicate(), Replicate())
    torch.testing.assert_close(out_x.full_tensor(), torch.cat([x, x], dim=1) * 2)
    assert tuple(out_y.shape) == (4, 5) and out_y.placements == (Replicate(), Shard(0))
    torch.testing.assert_close(out_y.full_tensor(), y + 1)
    xd = dt.distribute_tensor(x, mesh)  # already global: unchanged shape
    assert tuple(m(xd, y=y)[0].shape) == (3, 4)
