"""torch.optim on dtorch parameters: N steps of SGD (momentum), Adam and AdamW, foreach and single-tensor paths,
with ``clip_grad_norm_`` over sharded gradients and an LR scheduler, equal single-device torch (float32, 1e-5);
optimizer and model ``state_dict`` / ``load_state_dict``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from tests.training.models import MLP, assert_params_close, twin
from torch_dtorch import Replicate, Shard

TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_momentum": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, foreach=fe),
    "adam": lambda p, fe: torch.optim.Adam(p, lr=0.01, foreach=fe),
    "adamw": lambda p, fe: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=fe),
}


def _step(model: torch.nn.Module, x: Any, target: Any, opt: torch.optim.Optimizer, sched: Any) -> Any:
    opt.zero_grad(set_to_none=True)
    loss = F.mse_loss(model(x), target)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=opt.defaults.get("foreach"))
    opt.step()
    sched.step()
    return loss.detach(), norm


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_equal_torch(name: str, foreach: bool) -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
    dt.match_grad_placements(model)
    opt, ref_opt = OPTIMIZERS[name](model.parameters(), foreach), OPTIMIZERS[name](ref.parameters(), foreach)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for _ in range(4):
        x, target = torch.randn(5, 6), torch.randn(5, 5)
        loss, norm = _step(model, x, dt.distribute_tensor(target, mesh), opt, sched)
        want_loss, want_norm = _step(ref, x, target, ref_opt, ref_sched)
        torch.testing.assert_close(loss.full_tensor(), want_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(norm.full_tensor(), want_norm, atol=1e-5, rtol=1e-5)
    assert_params_close(model, ref)
    for p in model.parameters():  # optimizer state lives with the parameter's shards
        for v in opt.state[p].values():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                assert v.placements == p.placements


def test_adamw_dp_tp_mesh() -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN, tp_dim="tp")
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, foreach=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0 / (1 + s))
    batch = [Shard(0), Replicate()]
    for _ in range(3):
        x, target = torch.randn(6, 6), torch.randn(6, 5)
        _step(
            model, dt.distribute_tensor(x, mesh, batch), dt.distribute_tensor(target, mesh, batch), opt, sched
        )
        _step(ref, x, target, ref_opt, ref_sched)
    assert_params_close(model, ref)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clip_grad_norm_sharded(foreach: bool, norm_type: float) -> None:
    mesh = init_mesh((3,))
    torch.manual_seed(1)
    shapes, layouts = [(5, 3), (7,), (4, 4)], [[Shard(0)], [Replicate()], [Shard(1)]]
    grads = [torch.randn(s) for s in shapes]
    ref = [torch.zeros(s, requires_grad=True) for s in shapes]
    ours = [dt.distribute_tensor(torch.zeros(s), mesh, pl).requires_grad_() for s, pl in zip(shapes, layouts)]
    for r, o, g in zip(ref, ours, grads, strict=True):
        r.grad = g.clone()
        o.grad = dt.distribute_tensor(g, mesh, o.placements)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type=norm_type, foreach=foreach)
    got = torch.nn.utils.clip_grad_norm_(ours, 1.0, norm_type=norm_type, foreach=foreach)
    torch.testing.assert_close(got.full_tensor(), want)
    for r, o in zip(ref, ours, strict=True):
        assert o.grad.placements == o.placements
        torch.testing.assert_close(o.grad.full_tensor(), r.grad)


def test_optimizer_and_model_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, foreach=True)
    sched, ref_sched = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.9) for o in (opt, ref_opt))
    data = [(torch.randn(5, 6), torch.randn(5, 5)) for _ in range(4)]
    for x, t in data[:2]:
        _step(model, x, dt.distribute_tensor(t, mesh), opt, sched)
        _step(ref, x, t, ref_opt, ref_sched)
    # the model's state_dict holds dtorch tensors in their placements; their full values are torch's
    sd = model.state_dict()
    assert sd["in_proj.weight"].placements == (Shard(0),)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k].full_tensor(), v, atol=1e-5, rtol=1e-5)
    # a new optimizer (and scheduler) resumes from the saved state
    opt_sd, sched_sd = opt.state_dict(), sched.state_dict()
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=True)
    opt2.load_state_dict(opt_sd)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 1, gamma=0.9)
    sched2.load_state_dict(sched_sd)
    for x, t in data[2:]:
        _step(model, x, dt.distribute_tensor(t, mesh), opt2, sched2)
        _step(ref, x, t, ref_opt, ref_sched)
    assert_params_close(model, ref)
    # a plain torch state_dict loads into the distributed model shard by shard
    fresh = MLP()
    model.load_state_dict(fresh.state_dict())
    assert model.in_proj.weight.placements == (Shard(0),)
    assert_params_close(model, fresh)


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_compiled_optimizer_step_equals_torch(name: str) -> None:
    """``torch.compile(opt.step, backend="dtorch")`` on a dp x tp layout: after one eager step (which makes the
    optimizer state), 3 compiled steps equal torch's, and the state keeps the parameters' placements."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN, tp_dim="tp")
    dt.match_grad_placements(model)
    opt = OPTIMIZERS[name](model.parameters(), True)
    ref_opt = OPTIMIZERS[name](ref.parameters(), True)
    compiled_step = torch.compile(opt.step, backend="dtorch")
    gen = torch.Generator().manual_seed(5)
    batch = [Shard(0), Replicate()]
    for i in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(
            model(dt.distribute_tensor(x, mesh, batch)), dt.distribute_tensor(y, mesh, batch)
        ).backward()
        (opt.step if i == 0 else compiled_step)()
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    assert_params_close(model, ref)
    w = model.in_proj.weight
    for key, value in opt.state[w].items():
        if value.dim() > 0:
            assert value.placements == w.placements, key
