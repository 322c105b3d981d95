"""The accelerations of ``ExecuteConfig`` applied to a pipeline's transformer, in the order they must happen:
quantization (on the host weights, before they move to the mesh), fused operators, the step cache."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from torch_dtorch.apps.diffusion.cache import install_cache, scheduler_clock
from torch_dtorch.apps.diffusion.config import ExecuteConfig
from torch_dtorch.apps.diffusion.fuse import fuse_transformer
from torch_dtorch.apps.diffusion.quantize import quantize_transformer
from torch_dtorch.backend import dtorch_backend
from torch_dtorch.mesh import DeviceMesh

__all__ = ["apply_accelerations", "compiles_whole_forward"]


def compiles_whole_forward(config: ExecuteConfig) -> bool:
    """Whether ``ExecuteConfig(compile=True)`` compiles the transformer's whole forward: not with a step cache,
    which compiles the blocks before and after its decision itself (:class:`~.cache.CachedBlocks`)."""
    return config.compile and config.cache is None


def apply_accelerations(pipe: Any, transformer: nn.Module, mesh: DeviceMesh, config: ExecuteConfig) -> None:
    """Apply ``config.quant``, ``config.fuse`` and ``config.cache`` to ``transformer`` (in place, on the host,
    before its parameters are distributed)."""
    if config.quant is not None:
        quantize_transformer(transformer, config.quant, mesh)
    if config.fuse is not None:
        fuse_transformer(transformer, config.fuse)
    if config.cache is not None:
        scheduler = getattr(pipe, "scheduler", None)
        compile = None
        if config.compile:
            options = config.compile_options(mesh.device_type)
            compile = functools.partial(torch.compile, backend=dtorch_backend, options=options)
        clock = None if scheduler is None else scheduler_clock(scheduler)
        install_cache(transformer, config.cache, clock=clock, compile=compile)
