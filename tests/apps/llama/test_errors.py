"""Layouts that cannot work are refused before anything is placed, with a ModelLayoutError naming the fix."""

from __future__ import annotations

import pytest
import torch

from tests.apps.llama.helpers import SIZES, fresh_model, make_mesh
from torch_dtorch.apps.llama import parallelize_llama
from torch_dtorch.apps.llama.tiny import TinyLlama, tiny_llama
from torch_dtorch.errors import ModelLayoutError

pytest.importorskip("transformers", reason="needs transformers (test extra)")


@pytest.mark.parametrize(
    ("axes", "sizes", "cp_mode", "match"),
    [
        ({"tp": 3}, SIZES, "ulysses", r"tp=3 must divide the attention heads \(num_attention_heads=4, "),
        ({"tp": 4}, SIZES, "ulysses", r"num_key_value_heads=2"),
        (
            {"pp": 2},
            TinyLlama(num_hidden_layers=1),
            "ulysses",
            r"pp=2 stages but the model has 1 decoder layers",
        ),
        ({"cp": 2}, SIZES, "both", r"cp_mode='both' splits the cp axis .* got cp=2"),
        ({"cp": 2}, SIZES, "zigzag", r"cp_mode must be one of"),
        ({"sp": 2}, SIZES, "ulysses", r"unknown mesh axis name\(s\) \['sp'\]"),
    ],
    ids=["tp-heads", "tp-kv-heads", "pp-layers", "both-prime", "cp-mode", "axis-name"],
)
def test_layout_errors(axes: dict[str, int], sizes: TinyLlama, cp_mode: str, match: str) -> None:
    model = tiny_llama(sizes)
    before = model.model.layers[0].self_attn.q_proj.weight
    with pytest.raises(ModelLayoutError, match=match):
        parallelize_llama(model, make_mesh(axes), cp_mode=cp_mode)
    assert model.model.layers[0].self_attn.q_proj.weight is before  # nothing was placed


def test_unnamed_mesh_and_sub_mesh() -> None:
    import torch_dtorch as dt

    with pytest.raises(ModelLayoutError, match="the mesh has no axis names"):
        parallelize_llama(fresh_model(), dt.init_device_mesh("cpu", (2,)))
    with pytest.raises(ModelLayoutError, match="not a sub-mesh view"):
        parallelize_llama(fresh_model(), make_mesh({"dp": 2, "tp": 2})["tp"])


def test_not_a_llama() -> None:
    class Other(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = fresh_model().config
            self.body = torch.nn.Linear(4, 4)

    with pytest.raises(ModelLayoutError, match=r"has no module\(s\) \['model.embed_tokens'"):
        parallelize_llama(Other(), make_mesh({"tp": 2}))
