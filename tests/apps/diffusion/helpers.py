"""Shared helpers: run a tiny pipeline, single-device or parallelized, and compare images by PSNR."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline, tiny_pipeline

STEPS, SIZE = 2, 32


def generate(
    pipe: Any, *, batch: int = 1, height: int = SIZE, width: int = SIZE, seed: int = 0, **kwargs: Any
) -> torch.Tensor:
    """The images of one call as a float tensor in [0, 1] (``output_type="pt"``); ``kwargs`` go to the pipeline."""
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        **kwargs,
        prompt=["a red fox in the snow"] * batch,
        num_inference_steps=STEPS,
        height=height,
        width=width,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        max_sequence_length=8,
    )
    return out.images.cpu()


@functools.cache
def reference(model: str, batch: int) -> torch.Tensor:
    """Single-device diffusers on the same tiny pipeline and seed."""
    return generate(tiny_pipeline(model), batch=batch)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio of images in [0, 1] (inf when equal)."""
    mse = float(((a.double() - b.double()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def run_parallel(
    model: str,
    sizes: tuple[int, ...],
    names: tuple[str, ...],
    *,
    cp_mode: str = "ulysses",
    compile: bool = False,
    batch: int = 1,
    mode: str = "thread",
) -> torch.Tensor:
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names, mode=mode)
    config = ExecuteConfig(cp_mode=cp_mode, compile=compile)  # type: ignore[arg-type]
    pipe = parallelize_pipeline(tiny_pipeline(model), mesh, config)
    return generate(pipe, batch=batch)
