"""Shared pieces of the Llama app tests: the tiny model, the inputs, the torch reference and the mesh."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cache
from typing import Any, NamedTuple

import torch

import torch_dtorch as dt
from tests.eager.conftest import TEST_DEVICE, TEST_MODE
from torch_dtorch.apps.llama.tiny import TinyLlama, tiny_llama

#: 3 layers: pp=2 splits them unevenly; GQA (4 query heads, 2 key/value heads)
SIZES = TinyLlama(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3)
BATCH, PROMPT_LEN, NEW_TOKENS = 2, 7, 5  # odd prompt: uneven sequence shards under cp


class Reference(NamedTuple):
    ids: torch.Tensor
    logits: torch.Tensor
    tokens: torch.Tensor


def fresh_model() -> Any:
    return tiny_llama(SIZES, seed=0)


@cache
def reference() -> Reference:
    """Prefill logits and greedy tokens of single-device transformers."""
    model = fresh_model()
    ids = torch.randint(3, SIZES.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), **greedy())
    return Reference(ids, logits, tokens)


def greedy() -> dict[str, Any]:
    """Greedy decoding of exactly NEW_TOKENS tokens (a random model may emit </s> early)."""
    return {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}


def make_mesh(axes: Mapping[str, int], *, mode: str = TEST_MODE) -> dt.DeviceMesh:
    """The mesh of ``axes`` (in the suite's ``DTORCH_TEST_MODE`` / ``DTORCH_TEST_DEVICE`` unless ``mode`` is given)."""
    names = tuple(axes) or ("dp",)
    shape = tuple(axes.values()) or (1,)
    if TEST_DEVICE == "cuda":
        return dt.init_device_mesh("cuda", shape, mesh_dim_names=names, simulate=True, mode=mode)
    return dt.init_device_mesh("cpu", shape, mesh_dim_names=names, mode=mode)


def layout_id(axes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in axes.items()) or "single"


def layouts(max_devices: int = 4) -> list[dict[str, int]]:
    """Every choice of dp, tp, pp, cp in {1, 2} on at most ``max_devices`` devices (axes of size 1 left out)."""
    out: list[dict[str, int]] = []
    names = ("dp", "tp", "pp", "cp")
    for mask in range(16):
        axes = {n: 2 for i, n in enumerate(names) if mask >> i & 1}
        if math.prod(axes.values()) <= max_devices:
            out.append(axes)
    return sorted(out, key=len)
