"""Fast-path misses per decoded token of HF ``generate`` (issue 23): after a warm-up ``generate``, every aten call of
a decode step hits — the factories HF makes each token (``arange`` for the cache positions and the mask,
``full`` for the stopping flags, ``scalar_tensor(-inf)`` for the mask) and their consumers included
(``device/fastpath_factory.py``) — and nothing plans in full. Tokens equal single-device transformers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.apps.llama.helpers import SIZES, fresh_model, make_mesh
from torch_dtorch.apps.llama import parallelize_llama
from torch_dtorch.device import fastpath
from torch_dtorch.device.state import get_session

transformers = pytest.importorskip("transformers", reason="needs transformers (test extra)")

TOKENS = 6


class _Marks(transformers.LogitsProcessor):  # type: ignore[misc,name-defined]
    """Notes (misses, calls planned in full) once per generated token (a plain Python call: no op of its own)."""

    def __init__(self) -> None:
        self.marks: list[tuple[int, int]] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.marks.append((fastpath.stats["miss"], get_session().executor.constructor.num_planned))
        return scores


def _generate(
    model: Any, ids: torch.Tensor, *, on_dtorch: bool
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    marks = _Marks()
    to = (lambda t: t.to("dtorch")) if on_dtorch else (lambda t: t)
    out = model.generate(
        to(ids),
        attention_mask=to(torch.ones_like(ids)),
        max_new_tokens=TOKENS,
        min_new_tokens=TOKENS,
        do_sample=False,
        pad_token_id=0,
        logits_processor=transformers.LogitsProcessorList([marks] if on_dtorch else []),
    )
    per_token = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks.marks, marks.marks[1:], strict=False)]
    return out, per_token


@pytest.mark.parametrize("axes", [{}, {"tp": 2}], ids=["single", "tp=2"])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_misses_nothing(axes: dict[str, int], batch: int) -> None:
    model = parallelize_llama(fresh_model(), make_mesh(axes))
    ids = torch.randint(3, SIZES.vocab_size, (batch, 11), generator=torch.Generator().manual_seed(batch))
    want, _ = _generate(fresh_model(), ids, on_dtorch=False)
    # warm-up: the prefill, the decode shapes and lengths of this prompt. The first call defers HF's factories (no
    # mesh in sight: their consumers bind them, and the fast path learns where); the second makes them bound at
    # once, and the native kernel learns their consumers' templates (it keys bound inputs only)
    for _ in range(2):
        _generate(model, ids, on_dtorch=True)
    got, per_token = _generate(model, ids, on_dtorch=True)
    assert len(per_token) == TOKENS - 1
    # (misses, calls planned in full) per decode step. The first step's ``cat([input_ids, next_tokens])`` takes the
    # prompt's ids, uploaded lazily and still unbound: the native kernel cannot key an unbound element, so it
    # counts one miss there, served by the Python fast path (a template hit, nothing planned)
    assert [planned for _, planned in per_token] == [0] * (TOKENS - 1)
    assert per_token[0][0] <= 1 and [m for m, _ in per_token[1:]] == [0] * (TOKENS - 2), per_token
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(("axes", "moves"), [({}, False), ({"dp": 1, "tp": 2}, False), ({"dp": 2}, True)])
def test_inputs_move_only_where_the_layout_differs(
    axes: dict[str, int], moves: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's input hook redistributes an input only where its layout differs: on an axis of size 1, Shard
    and Replicate hold the same whole tensor (a decode step's fresh token was a redistribute per token on the
    ``dp=1`` mesh ``bench/llama_gpu.py`` uses); on ``dp=2`` the replicated prompt is still split over the batch."""
    from torch_dtorch.apps.llama import parallelize as llama_parallelize

    calls: list[tuple[int, ...]] = []
    real = llama_parallelize.redistribute

    def counting(t: Any, mesh: Any, want: Any) -> Any:
        calls.append(tuple(t.shape))
        return real(t, mesh, want)

    monkeypatch.setattr(llama_parallelize, "redistribute", counting)
    model = parallelize_llama(fresh_model(), make_mesh(axes))
    ids = torch.randint(3, SIZES.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    want, _ = _generate(fresh_model(), ids, on_dtorch=False)
    got, _ = _generate(model, ids, on_dtorch=True)
    assert torch.equal(got.full_tensor().cpu(), want)
    assert bool(calls) == moves, calls
