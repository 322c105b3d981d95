"""A transformers ``LlamaForCausalLM`` training step (loss backward, clip, AdamW) on a 2x2 dp x tp CPU mesh with
the upstream TP plan, 5 steps equal single-device torch (loss and parameters, float32)."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from tests.training.models import assert_grads_close, assert_params_close, twin
from torch_dtorch import Replicate, Shard
from torch_dtorch.apps.llama.parallelize import llama_tp_plan

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")

PLAN = llama_tp_plan()  # the Llama app's upstream (torchtitan) plan


def _step(model: torch.nn.Module, ids: torch.Tensor, opt: torch.optim.Optimizer) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def test_llama_for_causal_lm_dp_tp_training() -> None:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.parallelize_module(twin(ref), mesh, PLAN, tp_dim="tp")
    dt.match_grad_placements(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        ids = torch.randint(0, 64, (4, 8), generator=gen)
        loss = _step(model, dt.distribute_tensor(ids, mesh, [Shard(0), Replicate()]), opt)
        want = _step(ref, ids, ref_opt)
        torch.testing.assert_close(loss.full_tensor(), want, atol=1e-5, rtol=1e-5)
    assert_params_close(model, ref)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert (
        q.placements == (Replicate(), Shard(0)) and q.grad is not None and q.grad.placements == q.placements
    )


@pytest.mark.parametrize("axis", ["cp", "ulysses"])
def test_llama_for_causal_lm_sequence_sharded_gradients(axis: str) -> None:
    """Input ids sharded on the sequence of a context-parallel mesh: loss and gradients equal torch's (with grad,
    attention runs in its math form on dtorch tensors, so k/v are gathered, not ring/Ulysses)."""
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg)
    mesh = init_mesh((2,), mesh_dim_names=(axis,))
    model = dt.nn.replicate_module(twin(ref), mesh)
    dt.match_grad_placements(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    sharded = dt.distribute_tensor(ids, mesh, [Shard(1)])
    loss = model(input_ids=sharded, labels=sharded).loss
    loss.backward()
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss.detach().full_tensor(), want.detach(), atol=1e-5, rtol=1e-5)
    assert_grads_close(model.named_parameters(), ref.named_parameters())
