"""``dtorch diffuse --cache/--quant/--fuse``: the options reach ExecuteConfig, the skipped steps are printed, bad
values are clear errors (exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from torch_dtorch import cli

pytest.importorskip("diffusers")


def _run(tmp_path: Path, *extra: str) -> int:
    argv = ["diffuse", "--steps", "4", "--height", "32", "--width", "32", "--out", str(tmp_path / "a.png")]
    return cli.main([*argv, *extra])


def test_cache_quant_fuse_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(tmp_path, "--mesh", "tp=2", "--cache", "fbc:0", "--quant", "int8", "--fuse") == 0
    out = capsys.readouterr().out
    assert "cache fbc:0, quant int8, fused ops" in out
    assert "fbc cache (threshold 0): skipped 0 of 4 steps []" in out
    assert (tmp_path / "a.png").exists()
    assert (
        _run(tmp_path, "--cache", "tea:1000") == 0
    )  # a huge threshold skips every step but the first and last
    assert "tea cache (threshold 1000): skipped 2 of 4 steps [1, 2]" in capsys.readouterr().out


def test_vae_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    argv = ["diffuse", "--steps", "2", "--height", "64", "--width", "64", "--vae-tiling", "--vae-parallel"]
    assert cli.main([*argv, "--out", str(tmp_path / "b.png")]) == 0
    assert Image.open(tmp_path / "b.png").size == (64, 64)
    assert "VAE tiled, VAE decode on the mesh" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--cache", "lru:0.1"), "kind='lru' is not one of"),
        (("--cache", "fbc:x"), "is not a number"),
        (("--quant", "fp8"), "compute capability >= 8.9"),
    ],
)
def test_bad_values_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    assert _run(tmp_path, *flags) == 2
    assert message in capsys.readouterr().err
