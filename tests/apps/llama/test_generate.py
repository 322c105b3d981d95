"""parallelize_llama on every layout of dp / tp / pp / cp in {1, 2} (up to 4 devices) and every cp_mode: prefill
logits within 1e-4 of single-device transformers and HF ``generate`` (greedy, KV cache) giving the same tokens;
eager in thread mode here, compiled and process mode in ``test_generate_modes.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.apps.llama.helpers import (
    BATCH,
    PROMPT_LEN,
    SIZES,
    fresh_model,
    greedy,
    layout_cases,
    make_mesh,
    reference,
)
from tests.eager.conftest import thread_only
from torch_dtorch import Replicate, Shard
from torch_dtorch.apps.llama import parallelize_llama
from torch_dtorch.placement_rules.families import context_parallel as cpm

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")


@pytest.mark.parametrize(("axes", "cp_mode"), layout_cases(4))
def test_prefill_logits_and_greedy_generate(axes: dict[str, int], cp_mode: str) -> None:
    ref = reference()
    mesh = make_mesh(axes)
    model = parallelize_llama(fresh_model(), mesh, cp_mode=cp_mode)
    with torch.no_grad():
        logits = model(ref.ids.to("dtorch")).logits
    want_pl = model.dtorch_layout.input_placements(batch_dim=0, seq_dim=1, ndim=3, prefill=True)
    assert logits.placements == tuple(want_pl)  # batch on dp, sequence on cp, replicated on tp
    torch.testing.assert_close(logits.full_tensor(), ref.logits, rtol=1e-4, atol=1e-4)
    ids = ref.ids.to("dtorch")
    tokens = model.generate(ids, attention_mask=torch.ones_like(ref.ids).to("dtorch"), **greedy())
    assert torch.equal(dt.to_torch(tokens), ref.tokens)


@thread_only
@pytest.mark.parametrize(("cp_mode", "heads", "seq"), [("ulysses", 2, PROMPT_LEN), ("ring", 4, 4)])
def test_prefill_attention_is_context_parallel(cp_mode: str, heads: int, seq: int) -> None:
    """The workers' local attention really is split: Ulysses sees H/2 heads of the whole prompt, ring at most
    ceil(L/2) query rows (zig-zag blocks)."""
    ref = reference()
    model = parallelize_llama(fresh_model(), make_mesh({"cp": 2}), cp_mode=cp_mode)
    seen: list[tuple[int, ...]] = []
    cpm.local_attention_hooks.append(lambda device, q, k, v: seen.append(tuple(q.shape)))
    try:
        with torch.no_grad():
            dt.to_torch(model(ref.ids.to("dtorch")).logits)
    finally:
        cpm.local_attention_hooks.pop()
    assert seen, "no local attention observed"
    assert all(s[1] <= heads and s[2] <= seq for s in seen), seen
    assert max(s[1] for s in seen) == heads


def test_input_placements_follow_the_mesh() -> None:
    """Plain, unbound and already distributed inputs all land on the first stage in the layout's placements."""
    ref = reference()
    mesh = make_mesh({"dp": 2, "pp": 2})
    model = parallelize_llama(fresh_model(), mesh)
    first = model.dtorch_layout.first
    for ids in (ref.ids, ref.ids.to("dtorch"), dt.distribute_tensor(ref.ids, first, [Replicate()])):
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.device_mesh == first and logits.placements == (Shard(0),)
        torch.testing.assert_close(logits.full_tensor(), ref.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("family", "kv_heads"),
    [("Qwen2", 2), ("Mistral", 2), ("Llama", 4)],
    ids=["qwen2-gqa-bias", "mistral-gqa", "llama2-mha"],
)
def test_llama_family_models(family: str, kv_heads: int) -> None:
    """Qwen2 (q/k/v biases) and Mistral have Llama's module names; Llama-2 style multi-head attention (as many
    key/value heads as query heads): the same layout applies on tp x pp."""
    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    cfg = config_cls(
        vocab_size=SIZES.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = model_cls(cfg).eval()
    ids = torch.randint(3, SIZES.vocab_size, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    want = ref.generate(ids, attention_mask=torch.ones_like(ids), **greedy())
    model = model_cls(cfg).eval()
    model.load_state_dict(ref.state_dict())
    parallelize_llama(model, make_mesh({"tp": 2, "pp": 2}))
    got = model.generate(ids.to("dtorch"), attention_mask=torch.ones_like(ids).to("dtorch"), **greedy())
    assert torch.equal(dt.to_torch(got), want)


def test_generate_first_on_a_fresh_pool() -> None:
    """``generate`` as the very first call (no forward before, no op bound to a mesh yet)."""
    ref = reference()
    dt.shutdown()
    model = parallelize_llama(fresh_model(), make_mesh({"tp": 2, "pp": 2}))
    tokens = model.generate(
        ref.ids.to("dtorch"), attention_mask=torch.ones_like(ref.ids).to("dtorch"), **greedy()
    )
    assert torch.equal(dt.to_torch(tokens), ref.tokens)


def test_seeded_sampling_equals_torch() -> None:
    """HF sampling (top-k, temperature, ``torch.multinomial``) under a seed gives torch's tokens, in thread and
    process mode: the dtorch device draws ``multinomial`` on the controller from torch's own generator
    (``device/rng.py``)."""
    ref = reference()
    sample = {"do_sample": True, "top_k": 20, "temperature": 0.8, "max_new_tokens": 4, "pad_token_id": 0}
    torch.manual_seed(7)
    want = fresh_model().generate(ref.ids, attention_mask=torch.ones_like(ref.ids), **sample)
    model = parallelize_llama(fresh_model(), make_mesh({"tp": 2}))
    torch.manual_seed(7)
    got = model.generate(ref.ids.to("dtorch"), attention_mask=torch.ones_like(ref.ids).to("dtorch"), **sample)
    assert torch.equal(dt.to_torch(got), want)


def test_one_sync_per_decoded_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy ``generate`` fetches from the workers once per decoded token — HF's stopping check
    (``StopCheck``: ``bool(unfinished_sequences.max() == 0)``), which must read the flag before it can decide to
    run the next step (HF defers it one step only on ``mps``) — plus a fixed number per call (special-token and
    padding checks before the prefill)."""
    from torch_dtorch.device.state import get_session

    ref = reference()
    model = parallelize_llama(fresh_model(), make_mesh({"tp": 2}))
    ids, mask = ref.ids.to("dtorch"), torch.ones_like(ref.ids).to("dtorch")
    model.generate(ids, attention_mask=mask, **greedy())  # warm: plans made, pools started
    executor = type(get_session().executor)
    fetches = [0]
    fetch = executor.fetch

    def counting(self: Any, operand: Any) -> Any:
        fetches[0] += 1
        return fetch(self, operand)

    monkeypatch.setattr(executor, "fetch", counting)
    counts = {}
    for n in (2, 6):
        fetches[0] = 0
        model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        counts[n] = fetches[0]
    assert (counts[6] - counts[2]) / 4 == 1, counts
    assert counts[2] - 2 <= 6, counts  # the per-call setup: 5 fetches with transformers 5.x
