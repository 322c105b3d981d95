"""Acceptance: tiny random diffusers transformers under backend="dtorch" equal eager torch (built offline)."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard

from .models import SEQ_DIM, TINY_TRANSFORMERS, distribute_module, transformer_tp_plan

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow


MODELS = TINY_TRANSFORMERS
#: dtorch-tensor runs (SD3's patch embedding needs the aten.convolution rule of placement_rules/spatial.py)
DTORCH_MODELS = ["flux", "sd3"]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_plain_inputs_bit_identical(name: str) -> None:
    model, inputs = MODELS[name]()
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        out = torch.compile(model, backend="dtorch")(**inputs, return_dict=False)[0]
        assert torch.equal(out, ref)


@pytest.mark.parametrize("name", DTORCH_MODELS)
def test_one_device_bit_identical(name: str) -> None:
    model, inputs = MODELS[name]()
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        mesh = dt.init_device_mesh("cpu", (1,))
        distribute_module(model, mesh)
        din = {k: dt.distribute_tensor(v, mesh, [Replicate()]) for k, v in inputs.items()}
        out = torch.compile(model, backend="dtorch")(**din, return_dict=False)[0]
        assert torch.equal(out.full_tensor(), ref)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", DTORCH_MODELS)
def test_sequence_sharded(name: str, n: int) -> None:
    model, inputs = MODELS[name]()
    seq_dim = SEQ_DIM[name]
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        mesh = dt.init_device_mesh("cpu", (n,))
        distribute_module(model, mesh)
        din = {
            k: dt.distribute_tensor(v, mesh, [Shard(seq_dim)] if k == "hidden_states" else [Replicate()])
            for k, v in inputs.items()
        }
        out = torch.compile(model, backend="dtorch")(**din, return_dict=False)[0]
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", DTORCH_MODELS)
def test_tensor_parallel(name: str, n: int) -> None:
    model, inputs = MODELS[name]()
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        mesh = dt.init_device_mesh("cpu", (n,))
        distribute_module(model, mesh, transformer_tp_plan(model))
        din = {k: dt.distribute_tensor(v, mesh, [Replicate()]) for k, v in inputs.items()}
        out = torch.compile(model, backend="dtorch")(**din, return_dict=False)[0]
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", DTORCH_MODELS)
def test_compiled_cp_batch1_splits_attention_heads(name: str) -> None:
    """Compiled, batch 1, sequence sharded on a 2-device mesh: no attention in the LogicalGraph has its batch dim
    (size 1) sharded — the joint attention runs head-sharded (or with the CP kernel), so both devices work.
    SD3's tokens are sliced after the patch embedding (the convolution has no rule for sharded rows: sharding its
    input rows would move them to the batch dim of size 1), as the diffusion app does."""
    from torch_dtorch.backend.place import mesh_key, place

    model, inputs = MODELS[name]()
    inputs = {k: v[:1] if k not in ("img_ids", "txt_ids") else v for k, v in inputs.items()}
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        distribute_module(model, mesh)
        seq = [Shard(1)] if name == "flux" else [Replicate()]
        if name == "sd3":
            key = mesh_key(mesh)
            model.pos_embed.register_forward_hook(lambda m, a, out: place(out, key, 0, "S(1)"))
        din = {
            k: dt.distribute_tensor(v, mesh, seq if k == "hidden_states" else [Replicate()])
            for k, v in inputs.items()
        }
        reports: list[object] = []
        out = torch.compile(model, backend="dtorch", options={"reports": reports})(**din, return_dict=False)[
            0
        ]
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-4, atol=1e-5)
    sdpa = [ln for r in reports for ln in r.logical.splitlines() if "scaled_dot_product_attention" in ln]  # type: ignore[attr-defined]
    assert sdpa, reports
    for line in sdpa:
        assert "S(0)" not in line, line  # batch of 1 never sharded
        assert ": S(1)" in line or ": S(2)" in line, line  # heads (dim 1) or the sequence (dim 2, CP kernel)
