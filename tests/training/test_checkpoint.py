"""Sharded checkpoints (``dt.checkpoint.save`` / ``load``): each worker writes its own blocks; loading into another
layout (or into plain torch tensors) gives the saved values; a training run resumes on the same trajectory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from tests.training.models import MLP, assert_params_close, twin
from torch_dtorch import Replicate, Shard
from torch_dtorch.errors import DTorchError

TP = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
OTHER_TP = {"in_proj": RowwiseParallel(), "out_proj": ColwiseParallel()}
BATCH = [Shard(0), Replicate()]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, mesh: dt.DeviceMesh | None, seed: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(dt.distribute_tensor(x, mesh, BATCH) if mesh is not None else x).pow(2).mean().backward()
    opt.step()


def test_save_writes_per_device_blocks_and_loads_into_other_layouts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.fully_shard(dt.parallelize_module(twin(ref), mesh, TP, tp_dim="tp"), mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    _train(model, opt, mesh, 0)
    _train(ref, ref_opt, None, 0)
    dt.checkpoint.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [
        "controller.safetensors", "dtorch_checkpoint.json", *(f"shard-{d:05d}.safetensors" for d in range(4)),
    ]  # fmt: skip
    meta = json.loads((tmp_path / "dtorch_checkpoint.json").read_text())
    entry = meta["tensors"]["model.in_proj.weight"]
    assert entry["placements"] == "S(0)S(0)" and len(entry["shards"]) == 4
    assert (
        len(meta["tensors"]["model.norm.weight"]["shards"]) == 2
    )  # replicated on tp: written once per block
    # another layout (TP the other way round, no FSDP), after a step of its own: the load overwrites it
    other = dt.parallelize_module(MLP(), mesh, OTHER_TP, tp_dim="tp")
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.05)
    _train(other, other_opt, mesh, 5)
    state = {"model": other.state_dict(), "optim": other_opt.state_dict()}
    dt.checkpoint.load(state, checkpoint_id=tmp_path)
    other_opt.load_state_dict(state["optim"])
    assert other.in_proj.weight.placements == (Replicate(), Shard(1))
    assert_params_close(other, ref)
    for step in (1, 2):  # the resumed run follows torch's trajectory
        _train(other, other_opt, mesh, step)
        _train(ref, ref_opt, None, step)
    assert_params_close(other, ref)
    # plain torch tensors load too (a single-device model from a distributed checkpoint)
    plain = MLP()
    sd = {"model": plain.state_dict()}
    dt.checkpoint.load(sd, checkpoint_id=tmp_path)
    torch.testing.assert_close(plain.out_proj.weight, model.out_proj.weight.detach().full_tensor())


def test_load_checks_shapes_and_reshards(tmp_path: Path) -> None:
    mesh = init_mesh((2,))
    value = torch.randn(5, 3)
    dt.checkpoint.save({"w": dt.distribute_tensor(value, mesh, [Shard(0)])}, checkpoint_id=tmp_path)
    with pytest.raises(DTorchError, match=r"'w' has shape \(3, 5\)"):
        dt.checkpoint.load(
            {"w": dt.distribute_tensor(torch.zeros(3, 5), mesh, [Shard(0)])}, checkpoint_id=tmp_path
        )
    with pytest.raises(DTorchError, match="no entry 'v'"):
        dt.checkpoint.load({"v": torch.zeros(2)}, checkpoint_id=tmp_path)
    for placement in (Shard(1), Replicate()):  # uneven columns (2 + 1); every rank the whole tensor
        w = dt.distribute_tensor(torch.zeros(5, 3), mesh, [placement])
        dt.checkpoint.load({"w": w}, checkpoint_id=tmp_path)
        assert w.placements == (placement,)
        torch.testing.assert_close(w.full_tensor(), value)


def test_dcp_interop_both_ways(tmp_path: Path) -> None:
    """``dt.checkpoint.save_dcp`` writes a ``torch.distributed.checkpoint`` that plain torch's ``dcp.load`` reads
    (model and optimizer); ``load_dcp`` fills an FSDP + TP model and its optimizer in place from a checkpoint plain
    torch's ``dcp.save`` wrote, and the resumed run follows torch's trajectory."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.fully_shard(dt.parallelize_module(twin(ref), mesh, TP, tp_dim="tp"), mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    _train(model, opt, mesh, 0)
    _train(ref, ref_opt, None, 0)
    # dtorch -> DCP -> plain torch
    dt.checkpoint.save_dcp(
        {"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "a"
    )
    plain = MLP()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05)
    _train(plain, plain_opt, None, 9)  # creates optimizer state to load into
    state = {"model": plain.state_dict(), "optim": plain_opt.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "a", no_dist=True)
    plain_opt.load_state_dict(state["optim"])
    for p, q in zip(plain.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(
        plain_opt.state_dict()["state"][0]["exp_avg"], ref_opt.state_dict()["state"][0]["exp_avg"]
    )
    # plain torch -> DCP -> dtorch (another layout)
    # after `import torch_dtorch`, DCP's default writer needs per_thread_copy_ahead=0 (docs/training.md)
    writer = dcp.FileSystemWriter(tmp_path / "b", per_thread_copy_ahead=0)
    dcp.save({"model": ref.state_dict(), "optim": ref_opt.state_dict()}, storage_writer=writer, no_dist=True)
    other = dt.parallelize_module(MLP(), mesh, OTHER_TP, tp_dim="tp")
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.05)
    _train(other, other_opt, mesh, 5)
    state = {"model": other.state_dict(), "optim": other_opt.state_dict()}
    dt.checkpoint.load_dcp(state, checkpoint_id=tmp_path / "b")
    other_opt.load_state_dict(state["optim"])
    assert other.in_proj.weight.placements == (Replicate(), Shard(1))
    assert_params_close(other, ref)
    for step in (1, 2):
        _train(other, other_opt, mesh, step)
        _train(ref, ref_opt, None, step)
    assert_params_close(other, ref)
