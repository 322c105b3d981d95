"""Tensor-parallel layers: placements in and out, the collectives they imply, conversions and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
import torch_dtorch.nn as dnn
from tests.nn.conftest import init_mesh
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.errors import PlacementError


@pytest.fixture(scope="module")
def mesh() -> dt.DeviceMesh:
    return init_mesh((2, 2), mesh_dim_names=("dp", "tp"))


CASES = [
    (dnn.ColumnParallelLinear, Replicate(), Shard(2)),
    (dnn.ColumnParallelLinearReplicateOutput, Replicate(), Replicate()),
    (dnn.RowParallelLinear, Shard(2), Replicate()),
    (dnn.RowParallelLinearReplicateInputOutput, Replicate(), Replicate()),
]


@pytest.mark.parametrize(("cls", "inp", "out"), CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_linear_variants(mesh: dt.DeviceMesh, cls: type, inp: object, out: object) -> None:
    torch.manual_seed(0)
    w, b, x = torch.randn(12, 10), torch.randn(12), torch.randn(4, 3, 10)
    layer = cls(10, 12, device_mesh=mesh, weight=w, bias_value=b)
    xd = dt.distribute_tensor(x, mesh, [Shard(0), inp])
    y = layer(xd)
    assert y.placements == (Shard(0), out)
    torch.testing.assert_close(y.full_tensor(), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_tp_shard_type_and_layouts(mesh: dt.DeviceMesh) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(8, 6), torch.randn(2, 5, 6)
    col = dnn.Linear(6, 8, bias=False, device_mesh=mesh, tp_dim="tp", tp_shard_type="col", weight=w)
    assert col.weight.placements == (Replicate(), Shard(0))
    row = dnn.Linear(8, 6, device_mesh=mesh, tp_shard_type="row", output_layout=Shard(1))  # reduce-scatter
    rep = dnn.Linear(6, 8, bias=False, device_mesh=mesh, tp_shard_type=None, weight=w)
    xd = dt.distribute_tensor(x, mesh, [Replicate(), Replicate()])
    h = col(xd)
    y = row(h)
    assert h.placements == (Replicate(), Shard(2)) and y.placements == (Replicate(), Shard(1))
    want = F.linear(F.linear(x, w), row.weight.full_tensor(), row.bias.full_tensor())
    torch.testing.assert_close(y.full_tensor(), want, rtol=1e-5, atol=1e-5)
    partial = dnn.RowParallelLinear(8, 6, bias=False, device_mesh=mesh, output_layout=Partial())
    assert partial(h).placements == (Replicate(), Partial())
    assert rep(xd).placements == (Replicate(), Replicate())


def test_input_conversion_and_strict_error(mesh: dt.DeviceMesh) -> None:
    x = torch.randn(4, 6, 8)
    layer = dnn.ColumnParallelLinear(8, 4, device_mesh=mesh)
    seq_sharded = dt.distribute_tensor(x, mesh, [Replicate(), Shard(1)])
    y = layer(seq_sharded)  # documented conversion: all-gather the sequence on "tp"
    torch.testing.assert_close(
        y.full_tensor(), F.linear(x, layer.weight.full_tensor(), layer.bias.full_tensor())
    )
    strict = dnn.ColumnParallelLinear(8, 4, device_mesh=mesh, strict=True)
    with pytest.raises(PlacementError, match=r"ColumnParallelLinear.*S\(1\) on mesh axis 'tp'.*needs R"):
        strict(seq_sharded)
    with pytest.raises(PlacementError, match="must be Replicate on mesh axis 'tp'"):
        dnn.RowParallelLinearReplicateInputOutput(8, 4, device_mesh=mesh)(seq_sharded)
    # a plain torch tensor is distributed (Replicate)
    assert layer(x).placements == (Replicate(), Shard(2))


@pytest.mark.parametrize(
    ("cls", "kind", "out"),
    [
        (dnn.Embedding, "row", Replicate()),
        (dnn.Embedding, "col", Shard(2)),
        (dnn.EmbeddingReplicateOutput, "col", Replicate()),
        (dnn.Embedding, None, Replicate()),
    ],
)
def test_embedding_variants(mesh: dt.DeviceMesh, cls: type, kind: str | None, out: object) -> None:
    torch.manual_seed(0)
    w = torch.randn(11, 6)
    ids = torch.randint(0, 11, (4, 5))
    emb = cls(11, 6, device_mesh=mesh, tp_shard_type=kind, weight=w)
    y = emb(dt.distribute_tensor(ids, mesh, [Shard(0), Replicate()]))
    assert y.placements == (Shard(0), out)
    torch.testing.assert_close(y.full_tensor(), F.embedding(ids, w))


def test_bad_arguments(mesh: dt.DeviceMesh) -> None:
    with pytest.raises(ValueError, match="tp_shard_type must be"):
        dnn.Linear(4, 4, device_mesh=mesh, tp_shard_type="diag")  # type: ignore[arg-type]
    with pytest.raises(PlacementError, match="weight has shape"):
        dnn.Linear(4, 5, device_mesh=mesh, weight=torch.zeros(4, 4))
