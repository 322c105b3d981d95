"""An unmodified Hugging Face LlamaModel (tiny random config) on dtorch: it builds position ids, rotary tables and
masks internally with ``device=x.device``; they bind to the input's mesh. Compared with plain torch."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.nn import replicate_module

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face test needs transformers (test extra)"
)


def tiny_llama() -> tuple[object, object]:
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return cfg, transformers.LlamaModel(cfg).eval()


@pytest.mark.parametrize("num_devices", [1, 2])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_llama_forward_matches_torch(num_devices: int, grad: bool) -> None:
    cfg, model = tiny_llama()
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 7))
    with torch.no_grad():
        want = model(ids).last_hidden_state
    mesh = init_mesh((num_devices,))
    twin = transformers.LlamaModel(cfg).eval()
    twin.load_state_dict(model.state_dict())
    twin.to("dtorch")  # replicated parameters, bound to the mesh at first use
    placements = [Shard(0)] if num_devices > 1 else [Replicate()]
    x = dt.distribute_tensor(ids, mesh, placements)
    with torch.set_grad_enabled(grad):
        out = twin(x).last_hidden_state
    assert out.placements == tuple(placements)
    got = out.full_tensor()
    if num_devices == 1 and not grad:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_devices", [1, 2])
def test_generate_is_the_first_call_on_a_fresh_model(num_devices: int) -> None:
    """HF ``generate`` before any forward, on a fresh pool: its ``pad_token_id.to(input_ids.device)`` makes a dtorch
    scalar before any op has bound a mesh (it used to recurse forever). Greedy tokens equal torch's."""
    cfg, _ = tiny_llama()
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))  # on the suite's default device, like the model
    mask = torch.ones_like(ids)
    want = ref.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    dt.shutdown()  # nothing bound yet: the state a user's first call starts from
    mesh = init_mesh((num_devices,))
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.load_state_dict(ref.state_dict())
    replicate_module(model, mesh)  # placed by upload: no op has run on the mesh yet
    got = model.generate(
        ids.to("dtorch"), attention_mask=mask.to("dtorch"), max_new_tokens=6, do_sample=False
    )
    assert torch.equal(dt.to_torch(got).cpu(), want.cpu())
