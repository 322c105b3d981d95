"""The denoising loop stays on the mesh: the latents come back to the host once per pipeline call, not once per
step (no per-step sync), and the images still equal single-device diffusers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline, tiny_pipeline
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.executor.eager import EagerGraphExecutor

from .helpers import SIZE, psnr

pytest.importorskip("diffusers")

MIN_PSNR = 60.0


@contextmanager
def count_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Count the controller's blocking points: value fetches (``full_tensor``, ``item``, ``.cpu()``) and syncs."""
    counts = {"fetch": 0, "sync": 0}
    fetch, sync = EagerGraphExecutor.fetch, EagerGraphExecutor.sync

    def spy_fetch(self: EagerGraphExecutor, *args: Any, **kwargs: Any) -> Any:
        counts["fetch"] += 1
        return fetch(self, *args, **kwargs)

    def spy_sync(self: EagerGraphExecutor, *args: Any, **kwargs: Any) -> Any:
        counts["sync"] += 1
        return sync(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(EagerGraphExecutor, "fetch", spy_fetch)
        m.setattr(EagerGraphExecutor, "sync", spy_sync)
        yield counts


def run(pipe: Any, steps: int, **kwargs: Any) -> Any:
    pipe.set_progress_bar_config(disable=True)
    kwargs.setdefault("output_type", "pt")
    return pipe(
        prompt="a red fox in the snow",
        num_inference_steps=steps,
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(0),
        max_sequence_length=8,
        **kwargs,
    ).images


CASES = [
    ("flux", (2,), ("cp",), "ulysses", False, "thread"),
    ("flux", (2,), ("cp",), "ring", True, "thread"),
    ("sd3", (2, 2), ("cfg", "cp"), "ring", False, "thread"),
    ("sd3", (2,), ("tp",), "ulysses", True, "thread"),
]


@pytest.mark.parametrize(
    ("model", "sizes", "names", "cp_mode", "compile", "mode"),
    CASES + [pytest.param("flux", (2,), ("cp",), "ulysses", False, "process", marks=pytest.mark.slow)],
    ids=lambda v: str(v),
)
def test_one_fetch_per_call_not_per_step(
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    sizes: tuple[int, ...],
    names: tuple[str, ...],
    cp_mode: str,
    compile: bool,
    mode: str,
) -> None:
    """A 2-step and a 5-step call fetch the same number of values (one: the final latents) and never sync; the
    images equal single-device diffusers."""
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names, mode=mode)
    config = ExecuteConfig(cp_mode=cp_mode, compile=compile)  # type: ignore[arg-type]
    pipe = parallelize_pipeline(tiny_pipeline(model), mesh, config)
    run(pipe, 2)  # compiles (compile=True) and warms up
    per_call = {}
    for steps in (2, 5):
        with count_syncs(monkeypatch) as counts:
            got = run(pipe, steps)
        per_call[steps] = dict(counts)
        assert psnr(got, run(tiny_pipeline(model), steps)) >= MIN_PSNR, steps
    assert per_call[2] == per_call[5] == {"fetch": 1, "sync": 0}, per_call


def test_latents_stay_dtorch_between_steps() -> None:
    """The transformer returns dtorch tensors and the scheduler step runs on them; the user gets plain latents
    (``output_type="latent"``) equal to single-device diffusers."""
    pipe = parallelize_pipeline(
        tiny_pipeline("flux"), dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    )
    seen: list[tuple[int, bool]] = []

    def callback(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        seen.append((i, is_dtorch(kw["latents"])))
        return kw

    got = run(pipe, 3, output_type="latent", callback_on_step_end=callback)
    want = run(tiny_pipeline("flux"), 3, output_type="latent")
    assert isinstance(got, torch.Tensor) and not is_dtorch(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert seen == [(0, True), (1, True), (2, False)], seen  # back on the host after the last step only


@pytest.mark.parametrize("output_type", ["pt", "latent"])
def test_interrupted_loop_still_returns_plain_tensors(output_type: str) -> None:
    """A loop interrupted by its callback leaves the latents on the mesh (the last step never runs); the VAE decode
    (FLUX's ``_unpack_latents``) and the pipeline's ``__call__`` bring them back."""

    def stop(p: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        p._interrupt = True
        return kw

    pipe = parallelize_pipeline(
        tiny_pipeline("flux"), dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    )
    got = run(pipe, 4, output_type=output_type, callback_on_step_end=stop)
    want = run(tiny_pipeline("flux"), 4, output_type=output_type, callback_on_step_end=stop)
    assert not is_dtorch(got)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_scheduler_swapped_after_parallelize(monkeypatch: pytest.MonkeyPatch) -> None:
    """A scheduler set after ``parallelize_pipeline`` is wrapped at the first transformer call: still one fetch."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = parallelize_pipeline(
        tiny_pipeline("sd3"), dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cfg",))
    )
    pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config)
    with count_syncs(monkeypatch) as counts:
        got = run(pipe, 3)
    assert counts == {"fetch": 1, "sync": 0}, counts
    assert psnr(got, run(tiny_pipeline("sd3"), 3)) >= MIN_PSNR


@pytest.mark.parametrize("guidance_scale", [1.0, 7.0])
def test_sd3_patch_embedding_takes_row_sharded_latents(guidance_scale: float) -> None:
    """SD3 on 2 CP devices (batch 1 without guidance, the guidance batch of 2 with it): the latents stay row-sharded
    from step to step and the patch-embedding convolution (kernel == stride: no halo) takes them so — no all-gather
    in the loop (it was one of the latents per step); the images equal single-device diffusers."""
    pipe = parallelize_pipeline(
        tiny_pipeline("sd3"), dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    )
    with dt.profile() as prof:
        got = run(pipe, 3, guidance_scale=guidance_scale)
    convs = [s for s in prof.spans if s.name == "aten.convolution"]
    assert len(convs) == 3 * 2 and all(s.args["out"].endswith("S(2)") for s in convs), (
        convs
    )  # 3 steps, 2 ranks
    plans = [str(s.args.get("plan", "")) for s in prof.spans if s.category == "collective"]
    assert not [p for p in plans if "all_gather" in p], plans
    assert psnr(got, run(tiny_pipeline("sd3"), 3, guidance_scale=guidance_scale)) >= MIN_PSNR
