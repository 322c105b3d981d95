"""Compiled training: ``torch.compile(model, backend="dtorch")`` with ``requires_grad`` parameters gives a forward
and a backward per-rank program; ``loss.backward()`` runs the backward program; losses, gradients (in the
parameters' placements) and parameters after eager AdamW steps equal eager dtorch and single-device torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt
from tests.training.models import MLP, TinyLM, assert_grads_close, assert_params_close, twin
from torch_dtorch import Replicate, Shard

TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> dt.DeviceMesh:
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names)


def _train(
    model: torch.nn.Module, batches: list[tuple[Any, Any]], loss_fn: Callable[..., Any], steps: int = 3
) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    losses = []
    for x, y in batches[:steps]:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _values(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.full_tensor() if t.device.type == "dtorch" else t for t in ts]


def _batches(mesh: dt.DeviceMesh, placements: list[Any], n: int = 3) -> tuple[list[Any], list[Any]]:
    gen = torch.Generator().manual_seed(7)
    plain = [(torch.randn(8, 6, generator=gen), torch.randn(8, 5, generator=gen)) for _ in range(n)]
    ours = [
        (dt.distribute_tensor(x, mesh, placements), dt.distribute_tensor(y, mesh, placements))
        for x, y in plain
    ]
    return ours, plain


@pytest.mark.parametrize(
    "shape,names,batch",
    [((2,), ("tp",), "R"), ((2, 2), ("dp", "tp"), "S0R"), ((4,), ("tp",), "R")],
    ids=["tp2", "dp2xtp2", "tp4_uneven"],
)
def test_tp_mlp_compiled_training_equals_eager_and_torch(shape: Any, names: Any, batch: str) -> None:
    torch.manual_seed(0)
    ref = MLP()
    mesh = _mesh(shape, names)
    placements = [Replicate()] if batch == "R" else [Shard(0), Replicate()]
    eager = dt.parallelize_module(twin(ref), mesh, TP_PLAN, tp_dim="tp")
    compiled_model = dt.parallelize_module(twin(ref), mesh, TP_PLAN, tp_dim="tp")
    dt.match_grad_placements(eager)
    ours, plain = _batches(mesh, placements)
    compiled = torch.compile(compiled_model, backend="dtorch")
    got = _values(_train(compiled, ours, F.mse_loss))
    want_eager = _values(_train(eager, ours, F.mse_loss))
    want = _train(ref, plain, F.mse_loss)
    for a, b, c in zip(got, want_eager, want, strict=True):
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert_params_close(compiled_model, ref)
    for p in compiled_model.parameters():
        assert p.grad is not None and p.grad.placements == p.placements


def test_gradients_land_in_parameter_placements_inside_the_program() -> None:
    """Parameters placed by hand (no ``match_grad_placements`` hooks), the batch sharded on dp: a replicated
    weight's gradient is Partial after the backward's last op; the backward program reduces it itself, so it
    reaches ``.grad`` Replicate (and a Shard(0) weight's Shard(0)), equal to torch's, one program call per pass."""
    from torch_dtorch.backend.program import RunProgram
    from torch_dtorch.device.state import get_session

    torch.manual_seed(0)
    ref = MLP()
    mesh = _mesh((2,), ("dp",))
    model = twin(ref)
    for name, p in list(model.named_parameters()):
        owner, leaf = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        pl = [Shard(0)] if name == "in_proj.weight" else [Replicate()]
        setattr(owner, leaf, torch.nn.Parameter(dt.distribute_tensor(p.detach(), mesh, pl)))
    x, y = torch.randn(8, 6), torch.randn(8, 5)
    compiled = torch.compile(model, backend="dtorch")
    dx, dy = dt.distribute_tensor(x, mesh, [Shard(0)]), dt.distribute_tensor(y, mesh, [Shard(0)])
    F.mse_loss(compiled(dx), dy).backward()  # compiles both programs
    for p in model.parameters():
        p.grad = None
    runs: list[Any] = []
    ex = get_session().executor
    original = ex.append_with_outputs

    def spy(specs: Any, make: Any, **kw: Any) -> Any:
        out = original(specs, lambda ys: _record(make(ys)), **kw)
        return out

    def _record(instr: Any) -> Any:
        if isinstance(instr, RunProgram):
            runs.append(instr)
        return instr

    ex.append_with_outputs = spy  # type: ignore[method-assign]
    try:
        loss = F.mse_loss(compiled(dx), dy)
        loss.backward()
    finally:
        del ex.append_with_outputs
    assert len(runs) == 2  # the forward and the backward program
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.detach().full_tensor(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(model.named_parameters(), ref.named_parameters())


def test_input_gradient_and_accumulation() -> None:
    """A ``requires_grad`` input gets its gradient in its placements; two backward passes accumulate."""
    torch.manual_seed(0)
    ref = MLP()
    mesh = _mesh((2,), ("tp",))
    model = dt.parallelize_module(twin(ref), mesh, TP_PLAN)
    compiled = torch.compile(model, backend="dtorch")
    x = torch.randn(4, 6)
    dx = dt.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(True)
    rx = x.clone().requires_grad_(True)
    for _ in range(2):
        compiled(dx).sum().backward()
        ref(rx).sum().backward()
    assert dx.grad is not None and dx.grad.placements == (Shard(0),)
    torch.testing.assert_close(dx.grad.full_tensor(), rx.grad, atol=1e-5, rtol=1e-5)
    assert_grads_close(model.named_parameters(), ref.named_parameters())


def test_tiny_lm_compiled_training() -> None:
    """Embedding, RMSNorm, ReLU MLP and a vocab head with cross-entropy: 3 compiled steps equal torch."""
    torch.manual_seed(0)
    ref = TinyLM()
    mesh = _mesh((2,), ("tp",))
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    model = dt.parallelize_module(twin(ref), mesh, plan)
    dt.match_grad_placements(model)
    compiled = torch.compile(model, backend="dtorch")
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 11, (3, 5), generator=gen) for _ in range(3)]

    def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    got = _values(
        _train(
            compiled, [(dt.distribute_tensor(i, mesh), dt.distribute_tensor(i, mesh)) for i in ids], lm_loss
        )
    )
    want = _train(ref, [(i, i) for i in ids], lm_loss)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert_params_close(model, ref)


def test_plain_inputs_train_like_torch() -> None:
    """No dtorch tensor anywhere: both graphs run as plain torch on the caller's device."""
    torch.manual_seed(0)
    ref = MLP()
    model = twin(ref)
    compiled = torch.compile(model, backend="dtorch")
    x = torch.randn(4, 6)
    compiled(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shape", [(2,), (2, 2)], ids=["tp2", "dp2xtp2"])
def test_llama_for_causal_lm_compiled_training(shape: tuple[int, ...]) -> None:
    """A transformers ``LlamaForCausalLM`` with the upstream TP plan, compiled: 3 steps of loss backward,
    ``clip_grad_norm_`` and AdamW equal single-device torch (loss and parameters, float32)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")
    from torch_dtorch.apps.llama.parallelize import llama_tp_plan

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    names = ("tp",) if len(shape) == 1 else ("dp", "tp")
    mesh = _mesh(shape, names)
    model = dt.parallelize_module(twin(ref), mesh, llama_tp_plan(), tp_dim="tp")
    dt.match_grad_placements(model)
    compiled = torch.compile(model, backend="dtorch")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    batch = [Replicate()] if len(shape) == 1 else [Shard(0), Replicate()]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 64, (4, 8), generator=gen)
        d = dt.distribute_tensor(ids, mesh, batch)
        for m, o, i in ((compiled, opt, d), (ref, ref_opt, ids)):
            o.zero_grad(set_to_none=True)
            loss = m(input_ids=i, labels=i).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
            if m is compiled:
                got = loss.detach().full_tensor()
        torch.testing.assert_close(got, loss.detach(), atol=1e-5, rtol=1e-5)
    assert_params_close(model, ref)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert q.grad is not None and q.grad.placements == q.placements
