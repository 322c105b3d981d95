"""The VAE decode on the mesh (``ExecuteConfig(vae_parallel=True)``): tiled and untiled, FLUX and SD3, against
single-device diffusers on the same seed (PSNR >= 60 dB), with the decoder's work on every device."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline, tiny_pipeline

from .helpers import generate, psnr

pytest.importorskip("diffusers")

MIN_PSNR = 60.0
#: the tiny VAE's tiles are 32x32 pixels (16x16 latents, overlap 0.25): a 64x64 image is 3x3 tiles of 3 shapes
SIZE = 64


def _reference(model: str, *, tiling: bool, batch: int = 1) -> torch.Tensor:
    pipe = tiny_pipeline(model)
    if tiling:
        pipe.vae.enable_tiling()
    return generate(pipe, batch=batch, height=SIZE, width=SIZE)


def _on_mesh(model: str, sizes: tuple[int, ...], names: tuple[str, ...], **config: Any) -> Any:
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    return parallelize_pipeline(tiny_pipeline(model), mesh, ExecuteConfig(vae_parallel=True, **config))


@pytest.mark.parametrize(
    "model,sizes,names,tiling,batch",
    [
        ("flux", (2,), ("cp",), True, 1),
        ("flux", (4,), ("cp",), True, 1),
        ("sd3", (2, 2), ("cfg", "cp"), True, 1),
        ("flux", (2,), ("tp",), False, 2),
        ("sd3", (2,), ("cp",), False, 1),
    ],
)
def test_mesh_decode_equals_diffusers(
    model: str, sizes: tuple[int, ...], names: tuple[str, ...], tiling: bool, batch: int
) -> None:
    pipe = _on_mesh(model, sizes, names, vae_tiling=tiling)
    got = generate(pipe, batch=batch, height=SIZE, width=SIZE)
    want = _reference(model, tiling=tiling, batch=batch)
    assert got.shape == want.shape
    assert psnr(got, want) >= MIN_PSNR, psnr(got, want)


def test_tiles_are_decoded_on_every_device() -> None:
    """FLUX (no convolution in its transformer) on 4 CP devices: the decoder's convolutions run batch-sharded on
    all four workers; the tiled image differs from the untiled one (the tiling really happened) and equals
    diffusers' tiled decode."""
    pipe = _on_mesh("flux", (4,), ("cp",), vae_tiling=True)
    with dt.profile() as prof:
        got = generate(pipe, height=SIZE, width=SIZE)
    convs = [s for s in prof.spans if s.name == "aten.convolution"]
    assert sorted({s.device for s in convs}) == [0, 1, 2, 3]
    assert all(str(s.args["out"]).endswith("S(0)") for s in convs), {s.args["out"] for s in convs}
    untiled = _reference("flux", tiling=False)
    assert psnr(got, untiled) < math.inf
    assert psnr(got, _reference("flux", tiling=True)) >= MIN_PSNR


def test_encoding_stays_on_the_host() -> None:
    """Only the decode moves: ``vae.encode`` (image-to-image pipelines) still runs the host VAE."""
    pipe = _on_mesh("sd3", (2,), ("cp",))
    image = torch.rand(1, 3, 32, 32)
    got = pipe.vae.encode(image).latent_dist.mean
    want = tiny_pipeline("sd3").vae.encode(image).latent_dist.mean
    torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_mesh_decode_in_process_mode() -> None:
    """Worker processes: the decoder's weights are uploaded once, the tiles travel as the batch."""
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",), mode="process")
    config = ExecuteConfig(vae_parallel=True, vae_tiling=True)
    pipe = parallelize_pipeline(tiny_pipeline("sd3"), mesh, config)
    got = generate(pipe, height=SIZE, width=SIZE)
    assert psnr(got, _reference("sd3", tiling=True)) >= MIN_PSNR
