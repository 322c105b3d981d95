"""An unmodified Hugging Face ``LlamaModel`` (tiny random config, offline) under module parallelism: an upstream
``torch.distributed.tensor.parallel`` TP plan used unchanged, sequence parallelism, context parallelism on the
sequence, and pipeline stages; hidden states compared with single-device torch."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import torch_dtorch as dt
from tests.nn.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.nn import init_empty_weights, parallelize_module, replicate_module
from torch_dtorch.nn.pipeline import pipeline_forward, pipeline_parallel

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")

#: the plan one writes for torch.distributed.tensor.parallel.parallelize_module on a Llama
UPSTREAM_PLAN = {
    "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
    "layers.*.self_attn.q_proj": ColwiseParallel(),
    "layers.*.self_attn.k_proj": ColwiseParallel(),
    "layers.*.self_attn.v_proj": ColwiseParallel(),
    "layers.*.self_attn.o_proj": RowwiseParallel(),
    "layers.*.mlp.gate_proj": ColwiseParallel(),
    "layers.*.mlp.up_proj": ColwiseParallel(),
    "layers.*.mlp.down_proj": RowwiseParallel(),
}

#: torchtitan-style sequence parallel plan (norms on sequence shards, reduce-scatter / all-gather around them)
SP_PLAN = {
    "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "layers.*.input_layernorm": SequenceParallel(),
    "layers.*.post_attention_layernorm": SequenceParallel(),
    "layers.*.self_attn": PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
    ),
    "layers.*.self_attn.q_proj": ColwiseParallel(),
    "layers.*.self_attn.k_proj": ColwiseParallel(),
    "layers.*.self_attn.v_proj": ColwiseParallel(),
    "layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
    "layers.*.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "layers.*.mlp.gate_proj": ColwiseParallel(),
    "layers.*.mlp.up_proj": ColwiseParallel(),
    "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}


def config(num_layers: int = 2) -> object:
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def reference(cfg: object, ids: torch.Tensor) -> tuple[object, torch.Tensor]:
    torch.manual_seed(0)
    model = transformers.LlamaModel(cfg).eval()
    with torch.no_grad():
        return model, model(ids).last_hidden_state


def test_upstream_tp_plan_on_meta_model_dp_tp() -> None:
    """The upstream plan unchanged; the model built on meta, each worker loads only its shards."""
    cfg = config()
    ids = torch.randint(0, 64, (4, 7), generator=torch.Generator().manual_seed(1))
    ref, want = reference(cfg, ids)
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    with init_empty_weights():
        model = transformers.LlamaModel(cfg).eval()
    assert model.layers[0].self_attn.q_proj.weight.device.type == "meta"
    parallelize_module(model, mesh["tp"], UPSTREAM_PLAN, state_dict=ref.state_dict())
    q = model.layers[0].self_attn.q_proj.weight
    assert q.placements == (Shard(0),) and tuple(q.to_local(0).shape) == (16, 32)
    assert model.layers[1].mlp.down_proj.weight.placements == (Shard(1),)
    with torch.no_grad():
        out = model(dt.distribute_tensor(ids, mesh, [Shard(0), Replicate()])).last_hidden_state
    assert out.placements == (Shard(0), Replicate())
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)


def test_sequence_parallel_plan() -> None:
    cfg = config()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    ref, want = reference(cfg, ids)
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    model = transformers.LlamaModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, SP_PLAN)
    with torch.no_grad():
        out = model(dt.distribute_tensor(ids, mesh, [Replicate()])).last_hidden_state
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("names", [("cp",), ("ulysses",)])
def test_context_parallel_llama(names: tuple[str, ...]) -> None:
    """Sequence-sharded input ids: rotary positions and the causal mask follow the shards, no model change."""
    cfg = config()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    ref, want = reference(cfg, ids)
    mesh = init_mesh((2,), mesh_dim_names=names)
    model = transformers.LlamaModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    replicate_module(model, mesh)
    with torch.no_grad():
        out = model(dt.distribute_tensor(ids, mesh, [Shard(1)])).last_hidden_state
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)


def test_pipeline_tp_llama_microbatches() -> None:
    """Stages from mesh.unbind('pp'); position ids, rotary tables and masks land on each stage's mesh."""
    cfg = config(num_layers=3)
    ids = torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(4))
    ref, want = reference(cfg, ids)
    mesh = init_mesh((2, 2), mesh_dim_names=("pp", "tp"))
    model = transformers.LlamaModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    stages = pipeline_parallel(model, mesh, plan=UPSTREAM_PLAN, tp_dim="tp")
    assert stages.layer_stage == [0, 0, 1]
    assert model.layers[2].self_attn.q_proj.weight.device_mesh == stages.meshes[1]
    assert model.norm.weight.device_mesh == stages.meshes[1]
    with torch.no_grad():
        out = model(dt.distribute_tensor(ids, stages.meshes[0], [Replicate()])).last_hidden_state
        assert out.device_mesh.root == stages.meshes[1]
        torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)
        out = pipeline_forward(
            model, ids, num_microbatches=2, mesh=stages.meshes[0], output=lambda o: o.last_hidden_state
        )
    torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)


def test_upstream_tp_plan_compiled_in_one_graph() -> None:
    """The upstream plan, then ``torch.compile(backend="dtorch", fullgraph=True)``: the KV cache's
    ``torch.tensor([], device=...)`` (made before any mesh is in sight) stays a controller value while dynamo traces."""
    cfg = config()
    ids = torch.randint(0, 64, (4, 7), generator=torch.Generator().manual_seed(3))
    ref, want = reference(cfg, ids)
    mesh = init_mesh((2,), mesh_dim_names=("tp",))
    model = transformers.LlamaModel(cfg).eval()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh, UPSTREAM_PLAN)
    compiled = torch.compile(model, backend="dtorch", fullgraph=True)
    with torch.no_grad():
        for _ in range(2):  # the second call replays the shipped programs
            out = compiled(dt.distribute_tensor(ids, mesh, [Replicate()])).last_hidden_state
            torch.testing.assert_close(out.full_tensor(), want, rtol=1e-4, atol=1e-4)
