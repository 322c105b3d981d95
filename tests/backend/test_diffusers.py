"""Acceptance: tiny random diffusers transformers under backend="dtorch" equal eager torch (built offline)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard

from .models import distribute_module, tiny_flux, transformer_tp_plan

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.slow


def _sd3() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=8,
    ).eval()  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 4, 16),
        "pooled_projections": torch.randn(2, 8),
        "timestep": torch.tensor([0.5, 0.25]),
    }
    return model, inputs


MODELS = {"flux": tiny_flux, "sd3": _sd3}
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
    seq_dim = {"flux": 1, "sd3": 2}[name]  # flux: tokens; sd3: image rows
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


@pytest.mark.parametrize("name", DTORCH_MODELS)
def test_tensor_parallel(name: str) -> None:
    model, inputs = MODELS[name]()
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
        mesh = dt.init_device_mesh("cpu", (2,))
        distribute_module(model, mesh, transformer_tp_plan(model))
        din = {k: dt.distribute_tensor(v, mesh, [Replicate()]) for k, v in inputs.items()}
        out = torch.compile(model, backend="dtorch")(**din, return_dict=False)[0]
        torch.testing.assert_close(out.full_tensor(), ref, rtol=1e-4, atol=1e-5)
