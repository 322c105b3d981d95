"""HF ``generate`` on a parallelized Llama compiled with ``torch.compile(backend="dtorch")`` and on worker
processes: prefill logits within 1e-4 and greedy tokens equal to single-device transformers. Slow (compiles /
process pools); the eager thread-mode matrix is ``test_generate.py``."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.apps.llama.helpers import fresh_model, greedy, layout_id, make_mesh, reference
from torch_dtorch.apps.llama import parallelize_llama

pytest.importorskip("transformers", reason="needs transformers (test extra)")

COMPILED = [
    ({"tp": 2}, "ulysses"),
    ({"pp": 2}, "ulysses"),
    ({"cp": 2}, "ring"),
    ({"dp": 2, "cp": 2}, "ulysses"),
]


def _check(model: torch.nn.Module, *, calls: int = 1) -> None:
    ref = reference()
    with torch.no_grad():
        logits = model(ref.ids.to("dtorch")).logits
    torch.testing.assert_close(logits.full_tensor(), ref.logits, rtol=1e-4, atol=1e-4)
    mask = torch.ones_like(ref.ids).to("dtorch")
    for _ in range(calls):  # a second call replays the compiled programs (prefill and decode shapes)
        tokens = model.generate(ref.ids.to("dtorch"), attention_mask=mask, **greedy())
        assert torch.equal(dt.to_torch(tokens), ref.tokens)


@pytest.mark.slow
@pytest.mark.parametrize(("axes", "cp_mode"), COMPILED, ids=[f"{layout_id(a)}-{m}" for a, m in COMPILED])
def test_compiled_generate(axes: dict[str, int], cp_mode: str) -> None:
    torch._dynamo.reset()
    model = parallelize_llama(fresh_model(), make_mesh(axes), cp_mode=cp_mode)
    model.forward = torch.compile(model.forward, backend="dtorch")  # HF's way: generate calls self.forward
    _check(model, calls=2)


PROCESS = [({"tp": 2}, "ulysses"), ({"pp": 2}, "ulysses"), ({"cp": 2}, "ring")]


@pytest.mark.slow
@pytest.mark.parametrize(("axes", "cp_mode"), PROCESS, ids=[f"{layout_id(a)}-{m}" for a, m in PROCESS])
def test_process_mode_generate(axes: dict[str, int], cp_mode: str) -> None:
    model = parallelize_llama(fresh_model(), make_mesh(axes, mode="process"), cp_mode=cp_mode)
    _check(model)


@pytest.mark.slow
def test_process_mode_compiled_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    # workers compiling on a loaded 2-core machine (CI runs two test processes) can miss 1 s of heartbeats: this
    # test is about compiled generation, not failure detection (tests/cluster covers that)
    monkeypatch.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "30")
    # the compiling controller is silent for seconds too
    monkeypatch.setenv("DTORCH_CONTROLLER_TIMEOUT_S", "30")
    dt.shutdown()
    torch._dynamo.reset()
    model = parallelize_llama(fresh_model(), make_mesh({"tp": 2}, mode="process"))
    model.forward = torch.compile(model.forward, backend="dtorch")
    _check(model)
