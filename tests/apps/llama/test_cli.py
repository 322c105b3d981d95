"""``dtorch llama``: the tiny random model (default) and a saved folder (``--model-path``); the streamed text equals
single-device transformers' greedy text, and the throughput lines are printed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from torch_dtorch import cli
from torch_dtorch.apps.llama.cli import parse_mesh
from torch_dtorch.apps.llama.tiny import char_tokenizer, tiny_llama

pytest.importorskip("transformers", reason="needs transformers (test extra)")

PROMPT = "Hello, dtorch!"


def _want(model: torch.nn.Module, tokenizer: object, n: int, *, exact: bool) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # type: ignore[operator]
    extra = {"min_new_tokens": n} if exact else {}
    out = model.generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0, **extra
    )
    return PROMPT + tokenizer.decode(out[0, ids.shape[1] :])  # type: ignore[attr-defined]


def test_parse_mesh() -> None:
    assert parse_mesh("dp=1,tp=2,pp=2,cp=1") == {"tp": 2, "pp": 2}
    assert parse_mesh("dp=1") == {"dp": 1}
    for bad in ("tp", "tp=0", "xp=2", "tp=2,tp=2"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mesh(bad)


def test_tiny_model_streams_torch_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    want = _want(tiny_llama(seed=0), char_tokenizer(), 6, exact=True)
    rc = cli.main(
        [
            "llama",
            "--mesh",
            "dp=1,tp=2,pp=2,cp=1",
            "--prompt",
            PROMPT,
            "--max-new-tokens",
            "6",
            "--warmup",
            "0",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    assert out[0] == want
    assert "mesh tp=2,pp=2" in out[1]
    assert out[2].startswith("  prefill: 14 tokens in ") and "tokens/s" in out[2]
    assert out[3].startswith("  decode: 5 tokens in ") and "ms/token" in out[3]


def test_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, tokenizer = tiny_llama(seed=1), char_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    want = _want(model, tokenizer, 5, exact=False)
    rc = cli.main(
        ["llama", "--model-path", str(tmp_path), "--mesh", "cp=2", "--cp-mode", "ring", "--prompt", PROMPT,
         "--max-new-tokens", "5", "--warmup", "0"]
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert rc == 0 and out[0] == want
    assert str(tmp_path) in out[1] and "cp_mode ring" in out[1]
