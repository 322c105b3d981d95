"""Issue 24's training acceptance on worker processes (``mode="process"``), in every run of the suite: what the
thread-mode tests check through the workers' blobs or only under ``DTORCH_TEST_MODE=process``.

- ``zero_grad(set_to_none=True)`` sends the ``Free`` of the gradient's blobs to the worker processes (thread mode
  reads the blobs themselves: ``test_autograd.py::test_gradients_accumulate_and_zero_grad_frees``);
- ``clip_grad_norm_`` over sharded (uneven), replicated and ``Partial`` gradients, ``foreach`` on and off, l2 and inf;
- ``torch.compile(opt.step, backend="dtorch")`` from the first step with ``StepLR`` / ``LambdaLR`` schedules;
- the docs/training.md loop (dp × tp, dropout, clipping, AdamW, a schedule, ``zero_grad``) against CPU torch.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.models import MLP, twin
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.executor.instructions import Free

pytestmark = pytest.mark.slow  # starts worker processes (seconds on 2 cores)

TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}


@pytest.fixture(scope="module")
def meshes(process_meshes: dict[int, dt.DeviceMesh]) -> dict[int, dt.DeviceMesh]:
    return process_meshes


def test_zero_grad_set_to_none_frees_worker_blobs(meshes: dict[int, dt.DeviceMesh], monkeypatch) -> None:  # noqa: ANN001
    mesh = meshes[2]
    w = nn.Parameter(dt.distribute_tensor(torch.randn(6, 4), mesh, [Shard(1)]))
    x = dt.distribute_tensor(torch.randn(3, 6), mesh, [Replicate()])
    (x @ w).pow(2).sum().backward()
    grad_id = TABLE.lookup(w.grad, get_session().generation).id
    dt.sync()
    runner = get_session().executor.runner
    freed: list[int] = []
    submit = runner.submit

    def spy(batch):  # noqa: ANN001, ANN202
        freed.extend(i for instr in batch if isinstance(instr, Free) for i in instr.operand_ids)
        return submit(batch)

    monkeypatch.setattr(runner, "submit", spy)
    torch.optim.SGD([w], lr=0.1).zero_grad(set_to_none=True)
    assert w.grad is None
    gc.collect()
    dt.sync()
    assert grad_id in freed, "zero_grad(set_to_none=True) did not free the gradient on the worker processes"


@pytest.mark.parametrize("num_devices", [2, 4])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clip_grad_norm_on_processes(
    meshes: dict[int, dt.DeviceMesh], num_devices: int, foreach: bool, norm_type: float
) -> None:
    mesh = meshes[num_devices]
    gen = torch.Generator().manual_seed(1)
    shapes = [(5, 3), (7,), (4, 6), (3, 2)]  # 5 and 7 rows: uneven over 2 and 4 processes
    layouts = [[Shard(0)], [Replicate()], [Shard(1)], [Replicate()]]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    ref = [torch.zeros(s, requires_grad=True) for s in shapes]
    ours = [dt.distribute_tensor(torch.zeros(s), mesh, pl).requires_grad_() for s, pl in zip(shapes, layouts)]
    for r, o, g in zip(ref, ours, grads, strict=True):
        r.grad = g.clone()
        o.grad = dt.distribute_tensor(g, mesh, o.placements)
    ours[3].grad = dt.distribute_tensor(
        grads[3], mesh, [Partial()]
    )  # a replicated weight's unreduced gradient
    want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=norm_type, foreach=foreach)
    got = torch.nn.utils.clip_grad_norm_(ours, 0.5, norm_type=norm_type, foreach=foreach)
    torch.testing.assert_close(got.full_tensor(), want)
    for r, o in zip(ref, ours, strict=True):
        torch.testing.assert_close(o.grad.full_tensor(), r.grad)
    assert [o.grad.placements for o in ours[:3]] == [tuple(pl) for pl in layouts[:3]]


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]] = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i)),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_compiled_optimizer_step_with_lr_schedule_on_processes(
    meshes: dict[int, dt.DeviceMesh], schedule: str
) -> None:
    """AdamW's step compiled from the first step, the schedule changing ``lr`` every step: equals torch (1e-6)."""
    mesh = meshes[2]
    torch.manual_seed(0)
    ref = MLP()
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, foreach=True)
    sched, ref_sched = SCHEDULES[schedule](opt), SCHEDULES[schedule](ref_opt)
    step = torch.compile(opt.step, backend="dtorch")
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(dt.distribute_tensor(x, mesh)), dt.distribute_tensor(y, mesh)).backward()
        step()
        sched.step()
        ref_opt.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), atol=1e-6, rtol=0, msg=name)


class _DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.25)
        self.out_proj = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.drop(torch.relu(self.in_proj(x))))


def test_docs_training_loop_on_processes(meshes: dict[int, dt.DeviceMesh]) -> None:
    """docs/training.md's loop on a 2 × 2 (dp × tp) process mesh, dropout included: losses and parameters equal CPU
    torch after 3 steps (the batch of 6 is uneven over dp)."""
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), mode="process")
    torch.manual_seed(0)
    ref = _DropMLP()
    model = dt.parallelize_module(twin(ref), mesh["tp"], TP_PLAN)
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 2)
    gen = torch.Generator().manual_seed(5)
    for i in range(3):
        x, y = torch.randn(6, 6, generator=gen), torch.randint(0, 5, (6,), generator=gen)
        losses = []
        for m, o, s, inp, tgt in (
            (model, opt, sched, dt.distribute_tensor(x, mesh, [Shard(0), Replicate()]),
             dt.distribute_tensor(y, mesh, [Shard(0), Replicate()])),
            (ref, ref_opt, ref_sched, x, y),
        ):  # fmt: skip
            torch.manual_seed(100 + i)
            loss = F.cross_entropy(m(inp), tgt)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            s.step()
            o.zero_grad(set_to_none=True)
            losses.append(loss.detach().full_tensor() if loss.device.type == "dtorch" else loss.detach())
        torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is None
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), atol=1e-5, rtol=1e-5, msg=name)
