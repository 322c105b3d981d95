"""``dtorch diffuse``: the default tiny run writes a PNG; a ``save_pretrained`` folder loads with ``--model-path``
and gives the image single-device diffusers gives from the same folder."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torch_dtorch import cli
from torch_dtorch.apps.diffusion import tiny_pipeline
from torch_dtorch.apps.diffusion.cli import parse_mesh

from .helpers import psnr

pytest.importorskip("diffusers")
Image = pytest.importorskip("PIL.Image")


def _png(path: Path) -> torch.Tensor:
    with Image.open(path) as im:
        return torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0)


def test_default_tiny_run_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fox.png"
    rc = cli.main(["diffuse", "--steps", "2", "--height", "32", "--width", "32", "--out", str(out)])
    assert rc == 0
    assert _png(out).shape == (32, 32, 3)
    text = capsys.readouterr().out
    assert "mesh cp=2 (thread, cpu)" in text and "per step" in text and f"wrote {out}" in text


def test_sd3_cfg_compiled_on_worker_processes_at_the_default_steps(tmp_path: Path) -> None:
    """``dtorch diffuse --model sd3 --mesh cfg=2 --mode process --compile`` at the CLI's own 4 steps: the image of
    single-device diffusers. It failed at the fourth step: hit records made operand ids the compiled program had
    defined for itself, and the worker decoded the older operand (``tests/cluster/test_hits.py``)."""
    out = tmp_path / "sd3.png"
    argv = [
        "diffuse",
        "--model",
        "sd3",
        "--mesh",
        "cfg=2",
        "--mode",
        "process",
        "--compile",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    pipe = tiny_pipeline("sd3", seed=0)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt="a photo of a red fox in the snow",
        num_inference_steps=4,
        height=64,
        width=64,
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    want_t = torch.from_numpy(np.asarray(want.convert("RGB"), dtype=np.float32) / 255.0)
    assert psnr(_png(out), want_t) >= 40  # (8-bit PNGs of float32 images)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_save_pretrained_model_path_round_trip(model: str, tmp_path: Path) -> None:
    import diffusers

    folder = tmp_path / model
    tiny_pipeline(model, seed=3).save_pretrained(folder)
    mesh = "cfg=2" if model == "sd3" else "cp=2"
    out = tmp_path / "out.png"
    argv = ["diffuse", "--model", model, "--model-path", str(folder), "--mesh", mesh, "--steps", "2"]
    argv += [
        "--height",
        "32",
        "--width",
        "32",
        "--seed",
        "5",
        "--prompt",
        "a fox",
        "--max-sequence-length",
        "8",
    ]
    assert cli.main([*argv, "--out", str(out)]) == 0
    cls = diffusers.FluxPipeline if model == "flux" else diffusers.StableDiffusion3Pipeline
    pipe = cls.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt="a fox", num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(5),
        max_sequence_length=8,
    ).images[0]  # fmt: skip
    want_path = tmp_path / "want.png"
    want.save(want_path)
    assert (
        psnr(_png(out), _png(want_path)) >= 45.0
    )  # 8-bit PNGs: one level of rounding at most here and there


def test_parse_mesh() -> None:
    assert parse_mesh("cp=2,tp=1,cfg=1") == {"cp": 2}
    assert parse_mesh("cfg=2,cp=2") == {"cfg": 2, "cp": 2}
    assert parse_mesh("tp=1") == {"tp": 1}
    for bad in ("cp", "cp=0", "cp=2,cp=2", "cp=x"):
        with pytest.raises(Exception, match="--mesh"):
            parse_mesh(bad)


def test_bad_mesh_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["diffuse", "--mesh", "dp=2"]) == 2
    err = capsys.readouterr().err
    assert "dtorch diffuse: error:" in err and "mesh axes ['dp']" in err and "Traceback" not in err


def test_image_size_that_does_not_split_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["diffuse", "--steps", "1", "--height", "36", "--width", "36", "--out", str(tmp_path / "x.png")]
    assert cli.main(argv) == 2
    assert "81 image tokens" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
