"""Module-level training steps: parameters parallelized with upstream ParallelStyles, ``loss.backward()``, the
gradients equal single-device torch's and sit in their parameters' placements (Partial reduced)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from tests.training.models import MLP, TinyLM, assert_grads_close, twin
from torch_dtorch import Replicate, Shard

TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_mlp_gradients(tp: int) -> None:
    torch.manual_seed(0)
    ref = MLP()
    model = dt.parallelize_module(twin(ref), init_mesh((tp,), mesh_dim_names=("tp",)), TP_PLAN)
    dt.match_grad_placements(model)
    x = torch.randn(5, 6)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert model.in_proj.weight.grad.placements == (Shard(0),)
    assert model.out_proj.weight.grad.placements == (Shard(1),)
    assert_grads_close(model.named_parameters(), ref.named_parameters())


def test_dp_tp_mlp_gradients_reduce_partials() -> None:
    """Batch sharded on ``dp``: every parameter's gradient is a Partial sum over ``dp`` until the hook reduces it
    into the parameter's placements (Replicate on ``dp``)."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN, tp_dim="tp")
    assert dt.match_grad_placements(model) >= 0
    x = torch.randn(6, 6)
    y = model(dt.distribute_tensor(x, mesh, [Shard(0), Replicate()]))
    F.mse_loss(y, dt.distribute_tensor(torch.zeros(6, 5), mesh, [Shard(0), Replicate()])).backward()
    F.mse_loss(ref(x), torch.zeros(6, 5)).backward()
    assert model.in_proj.weight.grad.placements == (Replicate(), Shard(0))
    assert_grads_close(model.named_parameters(), ref.named_parameters())


def test_sequence_parallel_example_local_input() -> None:
    """pytorch/examples' sequence_parallel_example.py plan: a plain input declared ``Shard(0)`` is each rank's local
    shard (the global batch is n x local), as upstream."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    plan = {
        "in_proj": ColwiseParallel(input_layouts=Shard(0)),
        "out_proj": RowwiseParallel(output_layouts=Shard(0)),
    }
    model = dt.parallelize_module(
        twin(ref), mesh, plan
    )  # (it makes gradients arrive in the params' placements)
    local = torch.rand(4, 6)
    out = model(local)
    assert tuple(out.shape) == (8, 5) and out.placements == (Shard(0),)
    out.sum().backward()
    ref(torch.cat([local, local])).sum().backward()
    assert_grads_close(model.named_parameters(), ref.named_parameters())
    for name, p in model.named_parameters():  # the replicated norm's gradient is reduced, not left Partial
        assert p.grad.placements == p.placements, name


def test_sequence_parallel_norm_plain_input() -> None:
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(6)
    ref = twin(norm)
    mesh = init_mesh((3,), mesh_dim_names=("tp",))
    dt.parallelize_module(norm, mesh, {"": SequenceParallel(sequence_dim=1)})
    local = torch.randn(2, 3, 6)
    out = norm(local)
    assert tuple(out.shape) == (2, 9, 6) and out.placements == (Shard(1),)
    out.pow(2).sum().backward()
    ref(torch.cat([local] * 3, dim=1)).pow(2).sum().backward()
    assert norm.weight.grad.placements == (Replicate(),)
    assert_grads_close(norm.named_parameters(), ref.named_parameters())


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_tiny_lm_cross_entropy_gradients(mesh_shape: tuple[int, ...]) -> None:
    """Vocab-parallel embedding, RMSNorm, ReLU MLP, a column-parallel head and cross-entropy."""
    torch.manual_seed(0)
    ref = TinyLM()
    names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
    mesh = init_mesh(mesh_shape, mesh_dim_names=names)
    plan = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    }
    model = dt.parallelize_module(twin(ref), mesh, plan, tp_dim="tp")
    dt.match_grad_placements(model)
    ids, targets = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    pl = [Replicate()] if len(mesh_shape) == 1 else [Shard(0), Replicate()]
    logits = model(dt.distribute_tensor(ids, mesh, pl))
    loss = F.cross_entropy(logits.flatten(0, 1), dt.distribute_tensor(targets, mesh, pl).flatten())
    loss.backward()
    want = F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten())
    want.backward()
    torch.testing.assert_close(loss.detach().full_tensor(), want.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(model.named_parameters(), ref.named_parameters())
