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
