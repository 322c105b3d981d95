"""Every ``ExecuteConfig`` acceleration — step cache, int8 quantization, fused operators — on every parallel layout
(cp Ulysses, cp ring, Ulysses x ring, tp, tp x cp ring, cfg x cp) against the same option on one device; and with a
step cache every block's attention still sees the sequence sharded (ring: half of the joint sequence per device at
batch 2)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, TinySizes, parallelize_pipeline, tiny_pipeline
from torch_dtorch.apps.diffusion.cache import cache_report, install_cache, scheduler_clock
from torch_dtorch.apps.diffusion.config import CacheConfig, FuseConfig, QuantizeConfig
from torch_dtorch.apps.diffusion.fuse import fuse_transformer
from torch_dtorch.apps.diffusion.quantize import quantize_transformer
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement_rules.families import context_parallel as cpm

from .helpers import generate, psnr

pytest.importorskip("diffusers")

SIZES = TinySizes(num_layers=2, num_single_layers=2)
#: layout -> (model, mesh sizes, axis names, cp_mode)
LAYOUTS: dict[str, tuple[str, tuple[int, ...], tuple[str, ...], str]] = {
    "cp-ulysses": ("flux", (2,), ("cp",), "ulysses"),
    "cp-ring": ("flux", (2,), ("cp",), "ring"),
    "ulysses-x-ring": ("flux", (2, 2), ("ulysses", "ring"), "both"),
    "tp": ("flux", (2,), ("tp",), "ulysses"),
    "tp-x-cp-ring": ("sd3", (2, 2), ("tp", "cp"), "ring"),
    "cfg-x-cp": ("sd3", (2, 2), ("cfg", "cp"), "ulysses"),
}
OPTIONS: dict[str, dict[str, Any]] = {
    "cache": {"cache": CacheConfig(kind="fbc", force_skip=0.5)},
    "int8": {"quant": QuantizeConfig(kind="int8")},
    "fuse": {"fuse": FuseConfig()},
}


@functools.cache
def _one_device(model: str, option: str) -> torch.Tensor:
    """The plain diffusers pipeline with the same option applied to its transformer (no mesh)."""
    pipe = tiny_pipeline(model, sizes=SIZES)
    opts = OPTIONS[option]
    if "quant" in opts:
        quantize_transformer(pipe.transformer, opts["quant"], DeviceMesh.from_shape("cpu", (1,)))
    if "fuse" in opts:
        fuse_transformer(pipe.transformer, opts["fuse"])
    if "cache" in opts:
        install_cache(pipe.transformer, opts["cache"], clock=scheduler_clock(pipe.scheduler))
    return generate(pipe)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_on_layout_equals_one_device(option: str, layout: str) -> None:
    model, sizes, names, cp_mode = LAYOUTS[layout]
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    config = ExecuteConfig(cp_mode=cp_mode, **OPTIONS[option])  # type: ignore[arg-type]
    pipe = parallelize_pipeline(tiny_pipeline(model, sizes=SIZES), mesh, config)
    got = generate(pipe)
    if option == "cache":
        assert cache_report(pipe).skipped == [1]  # type: ignore[union-attr]
    assert psnr(got, _one_device(model, option)) >= 80.0, psnr(got, _one_device(model, option))


@pytest.mark.parametrize("kind", ["fbc", "tea"])
def test_cached_blocks_keep_the_sequence_sharded(kind: str) -> None:
    """The step cache holds every block inside one module; the hook that returns a block's outputs to the
    sequence shard still reaches each of them, so at batch 2 every block's ring attention holds half of the
    joint sequence for the whole batch (it was the batch split after the first block)."""
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    config = ExecuteConfig(cp_mode="ring", cache=CacheConfig(kind=kind, threshold=0.0))  # type: ignore[arg-type]
    pipe = parallelize_pipeline(tiny_pipeline("flux", sizes=SIZES), mesh, config)
    seen: set[tuple[int, ...]] = set()

    def hook(device: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        seen.add(tuple(q.shape))

    cpm.local_attention_hooks.append(hook)
    try:
        generate(pipe, batch=2)
    finally:
        cpm.local_attention_hooks.remove(hook)
    heads = pipe.transformer.config.num_attention_heads
    joint = (32 // 2 // 2) ** 2 + 8
    assert seen == {(2, heads, joint // 2, 8)}, seen


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_option_compiled_on_tp_x_cp_ring(option: str) -> None:
    model, sizes, names, cp_mode = LAYOUTS["tp-x-cp-ring"]
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    config = ExecuteConfig(cp_mode=cp_mode, compile=True, **OPTIONS[option])  # type: ignore[arg-type]
    pipe = parallelize_pipeline(tiny_pipeline(model, sizes=SIZES), mesh, config)
    assert psnr(generate(pipe), _one_device(model, option)) >= 80.0
