"""Per-shard loading: a tiny checkpoint saved with ``save_pretrained`` (safetensors), loaded on the meta device and
laid out by ``load_llama``; each worker holds only its shards; results equal transformers on the same weights."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

import torch_dtorch as dt
from tests.apps.llama.helpers import SIZES, greedy, make_mesh, reference
from torch_dtorch import Shard
from torch_dtorch.apps.llama.checkpoint import SafetensorsFolder, load_llama
from torch_dtorch.apps.llama.tiny import TinyLlama, tiny_llama

pytest.importorskip("transformers", reason="needs transformers (test extra)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(SIZES, seed=0).save_pretrained(path)
    return path


def test_safetensors_folder_is_zero_copy(checkpoint: Path) -> None:
    """Every tensor is a view of the memory-mapped file: its data pointer lies inside the mapping."""
    weights = SafetensorsFolder(checkpoint)
    model = tiny_llama(SIZES, seed=0)
    assert set(weights) == set(model.state_dict())
    (mapping,) = weights._maps
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    for name, want in model.state_dict().items():
        got = weights[name]
        assert start <= got.data_ptr() < start + len(mapping), name
        assert torch.equal(got, want), name


@pytest.mark.parametrize("axes", [{"pp": 2, "tp": 2}, {"dp": 2, "cp": 2}], ids=["pp=2,tp=2", "dp=2,cp=2"])
def test_load_llama_matches_transformers(checkpoint: Path, axes: dict[str, int]) -> None:
    ref = reference()
    model = load_llama(checkpoint, make_mesh(axes), cp_mode="ring")
    q = model.model.layers[0].self_attn.q_proj.weight
    if "tp" in axes:  # each worker of the first stage holds half of the query heads, the last stage none
        assert q.placements == (Shard(0),)
        assert [tuple(q.to_local(d).shape) for d in q.device_mesh.devices] == [(16, 32), (16, 32)]
        assert model.lm_head.weight.device_mesh == model.dtorch_layout.stages[1]
    with torch.no_grad():
        logits = model(ref.ids.to("dtorch")).logits
    torch.testing.assert_close(logits.full_tensor(), ref.logits, rtol=1e-4, atol=1e-4)
    tokens = model.generate(
        ref.ids.to("dtorch"), attention_mask=torch.ones_like(ref.ids).to("dtorch"), **greedy()
    )
    assert torch.equal(dt.to_torch(tokens), ref.tokens)


def test_tied_embeddings(tmp_path: Path) -> None:
    """A checkpoint without ``lm_head.weight`` (tied to the embedding) loads the head from the embedding."""
    sizes = TinyLlama(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, tie_word_embeddings=True
    )
    ref = tiny_llama(sizes, seed=3)
    ref.save_pretrained(tmp_path)
    assert "lm_head.weight" not in SafetensorsFolder(tmp_path)
    model = load_llama(tmp_path, make_mesh({"tp": 2}))
    ids = torch.randint(3, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids).logits
        got = model(ids).logits.full_tensor()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(dt.errors.DTorchError, match="no \\*.safetensors file"):
        SafetensorsFolder(tmp_path)
