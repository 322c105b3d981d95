"""Eager programs on 1-, 2-, 3-, 4- and 2x2-device CPU meshes equal single-device torch (bit-identical on 1 device)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import MESH_SHAPES, init_mesh, mesh_ids
from torch_dtorch import Partial, Replicate, Shard


def close(got: torch.Tensor, want: torch.Tensor, mesh: dt.DeviceMesh) -> None:
    if mesh.size() == 1:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def placements_for(mesh: dt.DeviceMesh, *options):  # noqa: ANN001, ANN201
    """A few placement combinations for a mesh, one entry per mesh axis."""
    return list(itertools.product(options, repeat=mesh.ndim))[:4]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=mesh_ids)
def test_mlp(shape: tuple[int, ...]) -> None:
    mesh = init_mesh(shape)
    torch.manual_seed(0)
    x, w1, b1, w2 = torch.randn(7, 10), torch.randn(13, 10), torch.randn(13), torch.randn(5, 13)
    want = F.linear(F.gelu(F.linear(x, w1, b1)), w2)
    col = [Replicate()] * (mesh.ndim - 1) + [Shard(0)]
    row = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
    dx = dt.distribute_tensor(x, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    y = F.linear(F.gelu(F.linear(dx, dt.distribute_tensor(w1, mesh, col), dt.distribute_tensor(b1, mesh, col))),
                 dt.distribute_tensor(w2, mesh, row))  # fmt: skip
    close(y.full_tensor(), want, mesh)


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=mesh_ids)
def test_attention_block(shape: tuple[int, ...]) -> None:
    mesh = init_mesh(shape)
    torch.manual_seed(1)
    b, s, h, d = 2, 5, 4, 3
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    heads = [Replicate()] * (mesh.ndim - 1) + [Shard(1)]
    dq, dk, dv = (dt.distribute_tensor(t, mesh, heads) for t in (q, k, v))
    out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
    assert out.placements == tuple(heads)
    close(out.full_tensor(), want, mesh)


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=mesh_ids)
def test_norms_softmax_reductions(shape: tuple[int, ...]) -> None:
    mesh = init_mesh(shape)
    torch.manual_seed(2)
    x, w = torch.randn(5, 7), torch.randn(7)
    for pl in placements_for(mesh, Shard(0), Shard(1), Replicate()):
        dx, dw = dt.distribute_tensor(x, mesh, pl), dt.distribute_tensor(w, mesh, [Replicate()] * mesh.ndim)
        close(F.layer_norm(dx, (7,), dw).full_tensor(), F.layer_norm(x, (7,), w), mesh)
        close(F.rms_norm(dx, (7,), dw).full_tensor(), F.rms_norm(x, (7,), w), mesh)
        close(torch.softmax(dx, -1).full_tensor(), torch.softmax(x, -1), mesh)
        close(dx.sum(0).full_tensor(), x.sum(0), mesh)
        close(dx.mean(-1, keepdim=True).full_tensor(), x.mean(-1, keepdim=True), mesh)
        close(dx.amax(1).full_tensor(), x.amax(1), mesh)
        assert dx.sum().item() == pytest.approx(x.sum().item(), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=mesh_ids)
def test_views_of_sharded_tensors(shape: tuple[int, ...]) -> None:
    mesh = init_mesh(shape)
    x = torch.randn(7, 6)
    for pl in placements_for(mesh, Shard(0), Shard(1)):
        dx = dt.distribute_tensor(x, mesh, pl)
        close(dx.t().full_tensor(), x.t(), mesh)
        close(dx.transpose(0, 1).full_tensor(), x.transpose(0, 1), mesh)
        for got, want in zip(dx.chunk(3, dim=1), x.chunk(3, dim=1), strict=True):
            close(got.full_tensor(), want, mesh)
        close(dx.narrow(0, 1, 4).full_tensor(), x.narrow(0, 1, 4), mesh)
        close(dx.view(7, 2, 3).full_tensor(), x.view(7, 2, 3), mesh)


ALL = [Replicate(), Shard(0), Shard(1), Partial()]


@pytest.mark.parametrize("shape", [(2,), (3,), (2, 2)], ids=mesh_ids)
def test_every_redistribute_transition_uneven(shape: tuple[int, ...]) -> None:
    mesh = init_mesh(shape)
    x = torch.randn(5, 7)
    for src in itertools.product(ALL, repeat=mesh.ndim):
        dx = dt.distribute_tensor(x, mesh, src)
        for dst in itertools.product(ALL, repeat=mesh.ndim):
            y = dx.redistribute(mesh, dst)
            assert y.placements == dst
            close(y.full_tensor(), x, mesh)


def test_partial_from_local_and_to_local() -> None:
    mesh = init_mesh((3,))
    parts = [torch.randn(4, 2) for _ in range(3)]
    p = dt.from_local(parts, mesh, [Partial()])
    torch.testing.assert_close(p.full_tensor(), sum(parts))
    s = dt.from_local([torch.randn(3, 2), torch.randn(3, 2), torch.randn(1, 2)], mesh, [Shard(0)])
    assert s.shape == (7, 2) and s.placements == (Shard(0),)
    assert torch.equal(s.to_local(1), s.full_tensor()[3:6])
    # shards that no torch.chunk split produces are refused, naming each bad device
    with pytest.raises(
        dt.errors.PlacementError, match="device 1: torch.float32 \\(2, 2\\) \\(expected \\(3, 2\\)\\)"
    ):
        dt.from_local([torch.randn(3, 2), torch.randn(2, 2), torch.randn(2, 2)], mesh, [Shard(0)])
