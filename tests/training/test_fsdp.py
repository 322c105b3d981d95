"""``dt.fully_shard``: parameters, gradients and optimizer state Shard(0) on the dp axis; training steps equal
single-device torch, alone and composed with tensor parallelism (the upstream "FSDP + TP" layout)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.eager.conftest import thread_only
from tests.training.conftest import init_mesh
from tests.training.models import MLP, TinyLM, assert_grads_close, assert_params_close, twin
from torch_dtorch import Replicate, Shard
from torch_dtorch.errors import MeshError

BATCH = [Shard(0), Replicate()]


def _lm_step(
    model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, opt: torch.optim.Optimizer
) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()
    opt.step()


def test_fully_shard_mlp_on_dp() -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((3,), mesh_dim_names=("dp",))
    model = dt.fully_shard(twin(ref), mesh)
    assert all(p.placements == (Shard(0),) for p in model.parameters())
    x = torch.randn(7, 6)
    y = model(dt.distribute_tensor(x, mesh, [Shard(0)]))
    assert all(p.placements == (Shard(0),) for p in model.parameters()), (
        "sharded parameters restored after forward"
    )
    y.pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    assert_grads_close(model.named_parameters(), ref.named_parameters())
    with torch.no_grad():  # eval: gathered parameters are dropped after the forward
        torch.testing.assert_close(model(dt.distribute_tensor(x, mesh, [Shard(0)])).full_tensor(), ref(x))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fsdp_tp_training_steps(tied: bool) -> None:
    """parallelize_module on mesh['tp'], fully_shard per block then the root on mesh['dp'], AdamW: 3 steps equal."""
    torch.manual_seed(0)
    ref = TinyLM()
    if tied:
        ref.head.weight = ref.embed.weight
    model = twin(ref)
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    dt.parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for block in (model.up, model.down):
        dt.fully_shard(block, mesh["dp"])
    dt.fully_shard(model, mesh["dp"])
    assert model.up.weight.placements == (Shard(0), Shard(0))
    assert model.down.weight.placements == (Shard(0), Shard(1))
    assert model.norm.weight.placements == (Shard(0), Replicate())
    assert (model.head.weight is model.embed.weight) == tied
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, foreach=True)
    batch = [Shard(0), Replicate()]
    for step in range(3):
        ids, targets = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
        _lm_step(
            model, dt.distribute_tensor(ids, mesh, batch), dt.distribute_tensor(targets, mesh, batch), opt
        )
        _lm_step(ref, ids, targets, ref_opt)
        if step == 0:
            assert_grads_close(model.named_parameters(), ref.named_parameters())
    assert_params_close(model, ref)
    state = opt.state[model.up.weight]
    assert state["exp_avg"].placements == (Shard(0), Shard(0))


def test_fully_shard_errors() -> None:
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(MeshError, match="1-d mesh"):
        dt.fully_shard(MLP(), mesh)
    model = dt.fully_shard(MLP(), mesh["dp"])
    with pytest.raises(MeshError, match="already fully sharded"):
        dt.fully_shard(model, mesh["dp"])


@thread_only  # counts the workers' blobs
def test_reshard_after_forward_frees_gathered_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``reshard_after_forward`` the gathered parameters (and the views autograd saves, ``weight.t()``) are
    dropped after the forward and gathered again in backward; the gradients are the same."""
    import gc

    from torch_dtorch.device.state import get_session
    from torch_dtorch.nn import fsdp

    regathered = []
    real_unpack = fsdp._unpack
    monkeypatch.setattr(fsdp, "_unpack", lambda x: (regathered.append(type(x).__name__), real_unpack(x))[1])
    mesh = init_mesh((2,), mesh_dim_names=("dp",))
    workers = {d: w for d, w in get_session().executor.runner.workers.items() if d in mesh.devices}
    x = torch.randn(6, 6)
    live, grads = {}, {}
    for reshard in (False, True):
        torch.manual_seed(0)
        model = dt.fully_shard(MLP(dim=6, hidden=64, out=40), mesh, reshard_after_forward=reshard)
        regathered.clear()
        y = model(dt.distribute_tensor(x, mesh, [Shard(0)]))
        gc.collect()
        dt.sync()
        live[reshard] = sum(b.tensor.numel() for b in workers[0].blobs.values() if b.tensor is not None)
        y.pow(2).sum().backward()
        grads[reshard] = [p.grad.full_tensor() for p in model.parameters()]
        assert ("_Resharded" in regathered) == reshard
        del model, y
        gc.collect()
    assert live[True] < live[False] - 64 * 6, live  # at least the gathered in_proj weight is gone
    for a, b in zip(grads[False], grads[True], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fsdp_gradients_versus_upstream_averaging(reduction: str) -> None:
    """What a port of an FSDP2 script gets. Upstream, each dp rank's loss is over its local batch and FSDP2
    averages the reduce-scattered gradients over dp (its gradient divide factor is the dp size). dtorch's loss is
    over the global batch and its gradient is that loss's exact gradient (the Partial over dp is summed): equal to
    single-device torch on the global batch in both cases, equal to upstream for a mean loss, ``dp`` times
    upstream's for a summed loss (docs/training.md, "FSDP gradients")."""
    dp = 2
    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((dp,), mesh_dim_names=("dp",))
    model = dt.fully_shard(twin(ref), mesh)
    x, y = torch.randn(8, 6), torch.randn(8, 5)

    def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, target, reduction=reduction)

    loss_of(
        model(dt.distribute_tensor(x, mesh, [Shard(0)])), dt.distribute_tensor(y, mesh, [Shard(0)])
    ).backward()
    loss_of(ref(x), y).backward()
    assert_grads_close(model.named_parameters(), ref.named_parameters())  # single-device torch, global batch
    # upstream FSDP2: every rank's local loss, gradients averaged over the dp ranks
    upstream = {name: torch.zeros_like(p) for name, p in ref.named_parameters()}
    for xs, ys in zip(x.chunk(dp), y.chunk(dp), strict=True):
        local = twin(ref)
        local.zero_grad(set_to_none=True)
        loss_of(local(xs), ys).backward()
        for name, p in local.named_parameters():
            upstream[name] += p.grad / dp
    factor = 1.0 if reduction == "mean" else float(dp)
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.grad.full_tensor(), factor * upstream[name], atol=1e-5, rtol=1e-5, msg=name
        )


def test_mesh_rank_queries_explain_single_controller() -> None:
    """Upstream's per-process mesh queries (the torchrun boilerplate of a port) raise, saying why and what to do."""
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    for call in (mesh["dp"].get_local_rank, mesh.get_rank, mesh.get_coordinate):
        with pytest.raises(MeshError, match="no current rank.*distribute_tensor"):
            call()
    with pytest.raises(MeshError, match="no process group.*redistribute"):
        mesh.get_group("tp")


def test_compiled_fsdp_tp_training_equals_torch() -> None:
    """``torch.compile(backend="dtorch")`` of an FSDP + TP module: the module's body is one forward and one
    backward program per step (the gather/restore hooks run eagerly around it, behind a graph break); 3 AdamW steps
    equal single-device torch, parameters stay Shard(0) on dp on top of their TP placements."""
    from torch_dtorch.backend.program import RunProgram
    from torch_dtorch.device.state import get_session

    torch.manual_seed(0)
    ref = MLP()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    plan = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    model = dt.fully_shard(dt.parallelize_module(twin(ref), mesh, plan, tp_dim="tp"), mesh["dp"])
    compiled = torch.compile(model, backend="dtorch")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    runs: list[Any] = []
    ex = get_session().executor
    original = ex.append_with_outputs

    def spy(specs: Any, make: Any, **kw: Any) -> Any:
        def record(ys: Any) -> Any:
            instr = make(ys)
            if isinstance(instr, RunProgram):
                runs.append(instr)
            return instr

        return original(specs, record, **kw)

    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)
        ex.append_with_outputs = spy  # type: ignore[method-assign]
        try:
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(
                compiled(dt.distribute_tensor(x, mesh, BATCH)), dt.distribute_tensor(y, mesh, BATCH)
            )
            loss.backward()
        finally:
            del ex.append_with_outputs
        if step > 0:  # the first step also compiles
            assert len(runs) == 2, runs  # the forward and the backward program
        runs.clear()
        opt.step()
        ref_opt.zero_grad(set_to_none=True)
        want = F.mse_loss(ref(x), y)
        want.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.detach().full_tensor(), want.detach(), atol=1e-5, rtol=1e-5)
    assert_params_close(model, ref)
    assert model.in_proj.weight.placements == (Shard(0), Shard(0))
    assert model.in_proj.weight.grad is not None and model.in_proj.weight.grad.placements == (
        Shard(0),
        Shard(0),
    )
