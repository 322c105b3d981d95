"""HF ``generate`` on a parallelized Llama compiled with ``torch.compile(backend="dtorch")`` and on worker
processes, on every layout of dp / tp / pp / cp in {1, 2} up to 4 devices and every cp_mode (cp=4 for ``"both"``):
greedy tokens equal single-device transformers, and the logits of every generation step (the prefill's last
position, then each decode step) within 1e-4. Slow (compiles, process pools); the eager thread-mode matrix, with the
whole prefill's logits, is ``test_generate.py``.

- compiled (thread mode): the whole matrix on a 2-layer model (the third layer adds ~30% dynamo tracing), each
  ``generate`` twice (the second replays the three compiled graphs: prefill, first decode, dynamic decode); the
  whole prefill's logits through the compiled forward on four layouts;
- process mode (eager): the whole matrix, the whole prefill's logits included;
- compiled in process mode: two layouts (tp; pp x cp ring).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.apps.llama.helpers import (
    SIZES,
    SIZES_2,
    fresh_model,
    greedy,
    layout_cases,
    layout_id,
    make_mesh,
    reference,
    step_reference,
)
from torch_dtorch.apps.llama import parallelize_llama
from torch_dtorch.apps.llama.tiny import TinyLlama

pytest.importorskip("transformers", reason="needs transformers (test extra)")


def _check_prefill_logits(model: torch.nn.Module) -> None:
    ref = reference()
    with torch.no_grad():
        logits = model(ref.ids.to("dtorch")).logits
    torch.testing.assert_close(logits.full_tensor(), ref.logits, rtol=1e-4, atol=1e-4)


def _check_generate(model: Any, sizes: TinyLlama, *, calls: int = 1) -> None:
    """Tokens equal torch's and every step's logits within 1e-4; further calls replay (tokens only)."""
    ref = step_reference(sizes)
    ids, mask = ref.ids.to("dtorch"), torch.ones_like(ref.ids).to("dtorch")
    out = model.generate(
        ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **greedy()
    )
    assert torch.equal(dt.to_torch(out.sequences), ref.tokens)
    assert len(out.logits) == len(ref.step_logits)
    for step, (got, want) in enumerate(zip(out.logits, ref.step_logits, strict=True)):
        torch.testing.assert_close(
            dt.to_torch(got), want, rtol=1e-4, atol=1e-4, msg=lambda m, s=step: f"step {s}: {m}"
        )
    for _ in range(calls - 1):
        tokens = model.generate(ids, attention_mask=mask, **greedy())
        assert torch.equal(dt.to_torch(tokens), ref.tokens)


def _compiled(model: Any, options: dict[str, Any] | None = None) -> Any:
    torch._dynamo.reset()
    # HF's way: generate calls self.forward
    model.forward = torch.compile(model.forward, backend="dtorch", options=options)
    return model


@pytest.mark.slow
@pytest.mark.parametrize(("axes", "cp_mode"), layout_cases(4))
def test_compiled_generate(axes: dict[str, int], cp_mode: str) -> None:
    model = parallelize_llama(fresh_model(SIZES_2), make_mesh(axes), cp_mode=cp_mode)
    _check_generate(_compiled(model), SIZES_2, calls=2)


PREFILL = [
    ({"tp": 2}, "ulysses"),
    ({"pp": 2}, "ulysses"),
    ({"cp": 2}, "ring"),
    ({"dp": 2, "cp": 2}, "ulysses"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("axes", "cp_mode"), PREFILL, ids=[f"{layout_id(a)}-{m}" for a, m in PREFILL])
def test_compiled_prefill_logits(axes: dict[str, int], cp_mode: str) -> None:
    """The whole prefill's logits through the compiled forward (``generate`` keeps only the last position's)."""
    model = parallelize_llama(fresh_model(), make_mesh(axes), cp_mode=cp_mode)
    _check_prefill_logits(_compiled(model))


@pytest.mark.slow
@pytest.mark.parametrize(("axes", "cp_mode"), layout_cases(4))
def test_process_mode_generate(axes: dict[str, int], cp_mode: str) -> None:
    model = parallelize_llama(fresh_model(), make_mesh(axes, mode="process"), cp_mode=cp_mode)
    _check_prefill_logits(model)
    _check_generate(model, SIZES)


PROCESS_COMPILED = [({"tp": 2}, "ulysses"), ({"pp": 2, "cp": 2}, "ring")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("axes", "cp_mode"), PROCESS_COMPILED, ids=[f"{layout_id(a)}-{m}" for a, m in PROCESS_COMPILED]
)
def test_process_mode_compiled_generate(
    axes: dict[str, int], cp_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # workers compiling on a loaded 2-core machine (CI runs two test processes) can miss 1 s of heartbeats: this
    # test is about compiled generation, not failure detection (tests/cluster covers that)
    monkeypatch.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "30")
    # the compiling controller is silent for seconds too
    monkeypatch.setenv("DTORCH_CONTROLLER_TIMEOUT_S", "30")
    dt.shutdown()
    model = parallelize_llama(fresh_model(SIZES_2), make_mesh(axes, mode="process"), cp_mode=cp_mode)
    _check_generate(_compiled(model), SIZES_2, calls=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "worker_compiler"), [("thread", "eager"), ("process", "eager"), ("thread", "inductor")]
)
def test_compiled_decode_replays_one_program(
    mode: str,
    worker_compiler: str,
    monkeypatch: pytest.MonkeyPatch,
    compiled_graphs: list[Any],
    symbolic_compiles: list[Any],
) -> None:
    """On a 1-device mesh the decode graph with the symbolic KV length (dynamo's third graph) ships one program:
    tokens and logits equal torch, and no call of a graph with symbolic sizes runs its ops eagerly. With the
    workers' inductor, the worker compiles that program once, for every KV length."""
    if mode == "process":  # as in test_process_mode_compiled_generate
        monkeypatch.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "30")
        monkeypatch.setenv("DTORCH_CONTROLLER_TIMEOUT_S", "30")
        dt.shutdown()
    try:
        model = parallelize_llama(fresh_model(SIZES_2), make_mesh({}, mode=mode))
        _check_generate(_compiled(model, {"worker_compiler": worker_compiler}), SIZES_2, calls=2)
    finally:
        if mode == "process":
            dt.shutdown()
    if worker_compiler == "inductor":  # one symbolic program, compiled once (its KV length a symbol)
        assert len(symbolic_compiles) == 1, symbolic_compiles
        assert any(isinstance(spec, str) for spec in symbolic_compiles[0]), symbolic_compiles
    symbolic = [g for g in compiled_graphs if g.symbolic]
    assert symbolic, "dynamo compiled no decode graph with symbolic sizes"
    assert [g.eager_calls for g in symbolic] == [0] * len(symbolic)
    assert [g.num_variants for g in symbolic] == [1] * len(symbolic)
