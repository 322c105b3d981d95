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
#: the compiled matrix's model: 2 layers (dynamo traces every layer: a third costs ~30% more compile time)
SIZES_2 = TinyLlama(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
BATCH, PROMPT_LEN, NEW_TOKENS = 2, 7, 5  # odd prompt: uneven sequence shards under cp


class Reference(NamedTuple):
    ids: torch.Tensor
    logits: torch.Tensor
    tokens: torch.Tensor


class StepReference(NamedTuple):
    ids: torch.Tensor
    tokens: torch.Tensor
    #: per generated token: the logits it was chosen from (the prefill's last position, then each decode step)
    step_logits: tuple[torch.Tensor, ...]


def fresh_model(sizes: TinyLlama = SIZES) -> Any:
    return tiny_llama(sizes, seed=0)


def _prompt() -> torch.Tensor:
    return torch.randint(3, SIZES.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(1))


@cache
def step_reference(sizes: TinyLlama = SIZES) -> StepReference:
    """Greedy tokens of single-device transformers and the logits of every generation step."""
    ids = _prompt()
    out = fresh_model(sizes).generate(
        ids, attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True, **greedy()
    )
    return StepReference(ids, out.sequences, tuple(out.logits))


@cache
def reference() -> Reference:
    """Prefill logits and greedy tokens of single-device transformers."""
    model = fresh_model()
    ids = _prompt()
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


def layout_cases(max_devices: int = 4) -> list[Any]:
    """``(axes, cp_mode)`` pytest params: every layout of :func:`layouts`, each cp layout with Ulysses and ring,
    and cp=4 with both."""
    import pytest

    out = []
    for axes in layouts(max_devices):
        modes = ("ulysses", "ring") if "cp" in axes else ("ulysses",)
        out += [
            pytest.param(axes, m, id=f"{layout_id(axes)}-{m}" if "cp" in axes else layout_id(axes))
            for m in modes
        ]
    out.append(pytest.param({"cp": 4}, "both", id="cp=4-both"))
    return out


def layouts(max_devices: int = 4) -> list[dict[str, int]]:
    """Every choice of dp, tp, pp, cp in {1, 2} on at most ``max_devices`` devices (axes of size 1 left out)."""
    out: list[dict[str, int]] = []
    names = ("dp", "tp", "pp", "cp")
    for mask in range(16):
        axes = {n: 2 for i, n in enumerate(names) if mask >> i & 1}
        if math.prod(axes.values()) <= max_devices:
            out.append(axes)
    return sorted(out, key=len)
