"""Ring context parallelism on the *joint* attention of FLUX and SD3 really rings.

Text and image q/k/v are concatenated along the sequence before attention; the communicating ``cat``
(``placement_rules/families/cat.py``) keeps that joint sequence sharded, so the ring kernel runs: every device
holds ``1/n`` of the joint sequence with every head and the whole batch, and the key/value blocks of every other
device pass through it. Checked on the workers' local attention inputs (not only on the images) at batch 1 and 2,
against single-device diffusers (PSNR >= 60 dB)."""

from __future__ import annotations

import math

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline, tiny_pipeline
from torch_dtorch.placement import Shard, local_shape
from torch_dtorch.placement_rules.families import context_parallel as cpm
from torch_dtorch.placement_rules.ranks import coords

from .helpers import generate, psnr

pytest.importorskip("diffusers")

MIN_PSNR = 60.0
#: joint sequence of the tiny pipelines at 32x32: image tokens + text tokens (FLUX: T5's 8; SD3: CLIP's 77 + T5's 8)
JOINT = {"flux": 64 + 8, "sd3": 64 + 77 + 8}

Shapes = dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]


def _run(model: str, sizes: tuple[int, ...], names: tuple[str, ...], cp_mode: str, batch: int) -> None:
    # SD3 without guidance: the transformer batch is the prompt batch (guidance would double it, and a batch that
    # divides the mesh is another way to split the work: here only the sequence may be split)
    extra = {"guidance_scale": 1.0} if model == "sd3" else {}
    want = generate(tiny_pipeline(model), batch=batch, **extra)
    pipe = tiny_pipeline(model)
    heads = pipe.transformer.config.num_attention_heads
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    parallelize_pipeline(pipe, mesh, ExecuteConfig(cp_mode=cp_mode))  # type: ignore[arg-type]
    seen: Shapes = {}

    def hook(device: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        seen.setdefault(device, []).append((tuple(q.shape), tuple(k.shape)))

    cpm.local_attention_hooks.append(hook)
    try:
        with dt.profile() as prof:
            got = generate(pipe, batch=batch, **extra)
    finally:
        cpm.local_attention_hooks.remove(hook)
    assert psnr(got, want) >= MIN_PSNR, psnr(got, want)
    n = math.prod(sizes)
    assert sorted(seen) == list(range(n)), seen
    ring = sizes[names.index("ring")] if "ring" in names else n
    ulysses = n // ring
    # the joint sequence's chunks (torch.chunk sizes, nested over the mesh axes): a ring block is one rank's chunk
    # (after a Ulysses exchange a rank holds its group's chunks, and the ring runs them block by block)
    chunks = {local_shape((JOINT[model],), sizes, [Shard(0)] * len(sizes), c)[0] for c in coords(sizes)}
    for device, shapes in seen.items():
        for qs, ks in shapes:
            # the whole batch, every head (of this Ulysses group), 1/n of the joint sequence, queries and keys
            assert qs[0] == batch and qs[1] == heads // ulysses, (device, qs)
            assert qs[2] in chunks and ks[2] in chunks, (device, qs, ks, chunks)
        # every attention call on this device met the key blocks of the whole ring (they rotated through it)
        assert len(shapes) % ring == 0 and len(shapes) >= ring
    attention = {s.device for s in prof.spans if s.name.startswith("aten.scaled_dot_product_attention")}
    assert attention == set(range(n)), attention  # the attention kernels' time is spread over every device


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_ring_keeps_the_joint_sequence_sharded(model: str, batch: int) -> None:
    _run(model, (2,), ("cp",), "ring", batch)


def test_ring_on_four_devices_uneven_blocks() -> None:
    """FLUX's joint sequence of 72 on 4 devices (18 each) and SD3's 149 (38, 38, 38, 35: torch.chunk sizes)."""
    _run("flux", (4,), ("cp",), "ring", 1)
    _run("sd3", (4,), ("cp",), "ring", 1)


def test_ulysses_inside_ring_across() -> None:
    """cp_mode='both': half of the heads per Ulysses pair, the pair's joint sequence split again by the ring."""
    _run("flux", (2, 2), ("ulysses", "ring"), "both", 1)
