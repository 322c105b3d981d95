"""How many calls HF ``generate`` plans in full per decoded token (``GraphConstructor.num_planned``: fast-path
misses), on a tiny Llama — a regression of the eager fast path on decode shows here first.

Each decode step at a length no earlier step reached meets new input *shapes* (the KV-cache, ``input_ids`` and
attention-mask ``cat``s, the ``[:, -1:]`` slices of the growing ``input_ids`` / position ids, SDPA over the grown
cache): their templates are derived from the decision kept for their growth key (``device/fastpath_grow.py``), so
after the first decode step of a prompt nothing plans in full; the gapped slices' consumers (``isin``, ``clone``,
``add``) hit their stride pattern's template. Repeating a ``generate`` (lengths seen) plans nothing per token.
Tokens and every step's logits equal single-device transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.apps.llama.helpers import SIZES, fresh_model, make_mesh
from torch_dtorch.apps.llama import parallelize_llama
from torch_dtorch.device.state import get_session

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")

#: full plans per decoded token at new lengths, after the first decode step (measured: 0 under every layout here;
#: dp=2 x tp=2 plans SDPA each token — the tiny model's 4/2 GQA heads do not split in whole groups over 4 devices,
#: so the rule offers no head signature and the matcher moves heads to the batch, a decision that is not free)
MAX_NEW_LENGTH_PLANS = {"single": 0, "tp=2": 0, "dp=2": 0, "cp=2": 0}
TOKENS = 8


class _Marks(transformers.LogitsProcessor):  # type: ignore[misc,name-defined]
    """Records ``num_planned`` once per generated token (a plain Python call: no op of its own)."""

    def __init__(self) -> None:
        self.marks: list[int] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.marks.append(get_session().executor.constructor.num_planned)
        return scores


def _generate(model: Any, ids: torch.Tensor, **kw: Any) -> tuple[Any, list[int]]:
    marks = _Marks()
    out = model.generate(
        ids.to("dtorch"),
        attention_mask=torch.ones_like(ids).to("dtorch"),
        max_new_tokens=TOKENS,
        min_new_tokens=TOKENS,
        do_sample=False,
        pad_token_id=0,
        logits_processor=transformers.LogitsProcessorList([marks]),
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    return out, [b - a for a, b in zip(marks.marks, marks.marks[1:], strict=False)]


@pytest.mark.parametrize(
    "axes", [{}, {"tp": 2}, {"dp": 2}, {"cp": 2}], ids=["single", "tp=2", "dp=2", "cp=2"]
)
def test_full_plans_per_decoded_token(axes: dict[str, int]) -> None:
    model = parallelize_llama(fresh_model(), make_mesh(axes))
    torch_model = fresh_model()
    bound = MAX_NEW_LENGTH_PLANS[",".join(f"{k}={v}" for k, v in axes.items()) or "single"]
    warm = torch.randint(3, SIZES.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    _generate(model, warm)  # plans the prefill and the first lengths
    for length in (13, 29):  # lengths no earlier call reached
        ids = torch.randint(3, SIZES.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
        out, per_token = _generate(model, ids)
        steady = per_token[1:]  # (the first decode step also meets the decode shapes of this prompt)
        assert max(steady) <= bound, per_token
        again, seen = _generate(model, ids)
        assert sum(seen[1:]) == 0, seen  # lengths seen before: every call of a decode step is a fast-path hit
        ref = torch_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=TOKENS,
            min_new_tokens=TOKENS,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for got in (out, again):
            assert torch.equal(got.sequences.cpu(), ref.sequences)
            for a, b in zip(got.logits, ref.logits, strict=True):
                torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4)
