"""Step caches (First-Block Cache, TeaCache): threshold 0 is exactly uncached; above it, the decisions equal a plain
reference implementation of each rule on the recorded signals; a skipping run on a mesh equals the same cache on a
single device; cp and tp layouts, eager and compiled."""

from __future__ import annotations

import math

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, TinySizes, parallelize_pipeline, tiny_pipeline
from torch_dtorch.apps.diffusion.cache import (
    FLUX_TEA_COEFFICIENTS,
    cache_report,
    cache_state,
    install_cache,
    rescale,
    scheduler_clock,
)
from torch_dtorch.apps.diffusion.config import CacheConfig
from torch_dtorch.errors import PipelineParallelError

from . import helpers
from .helpers import psnr

pytest.importorskip("diffusers")

SIZES = TinySizes(num_layers=2, num_single_layers=2)
STEPS = 6
LAYOUTS = {"cp2": ((2,), ("cp",)), "tp2": ((2,), ("tp",))}


def _generate(pipe: object, steps: int = STEPS) -> torch.Tensor:
    old = helpers.STEPS
    helpers.STEPS = steps
    try:
        return helpers.generate(pipe)
    finally:
        helpers.STEPS = old


def _parallel(
    model: str, layout: str, cache: CacheConfig | None, *, compile: bool = False
) -> tuple[object, torch.Tensor]:
    sizes, names = LAYOUTS[layout]
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    pipe = parallelize_pipeline(
        tiny_pipeline(model, sizes=SIZES), mesh, ExecuteConfig(compile=compile, cache=cache)
    )
    return pipe, _generate(pipe)


# --- plain reference implementations of the two rules (host tensors, no dtorch) ----------------------------------


def _rel_l1(x: torch.Tensor, prev: torch.Tensor) -> float:
    return float((x.double() - prev.double()).abs().mean() / prev.double().abs().mean())


def fbc_reference(residuals: list[torch.Tensor], threshold: float) -> list[int]:
    """ParaAttention's First-Block Cache: skip when the first block's residual is within ``threshold`` (relative
    L1) of the one of the last *computed* step."""
    skipped, prev = [], None
    for step, r in enumerate(residuals):
        if prev is not None and _rel_l1(r, prev) < threshold:
            skipped.append(step)
        else:
            prev = r
    return skipped


def tea_reference(
    signals: list[torch.Tensor], threshold: float, coefficients: tuple[float, ...]
) -> list[int]:
    """TeaCache4FLUX: accumulate the rescaled relative L1 of the modulated input; compute the first and the last
    step and whenever the sum reaches the threshold (then restart it)."""
    import numpy as np

    poly = np.poly1d(coefficients)
    skipped, acc = [], 0.0
    for step, s in enumerate(signals):
        if step in (0, len(signals) - 1):
            acc = 0.0
            continue
        acc += float(poly(_rel_l1(s, signals[step - 1])))
        if acc < threshold:
            skipped.append(step)
        else:
            acc = 0.0
    return skipped


# --- tests ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fbc", "tea"])
@pytest.mark.parametrize("model,layout", [("flux", "cp2"), ("sd3", "tp2")])
def test_threshold_zero_is_exactly_uncached(kind: str, model: str, layout: str) -> None:
    _, plain = _parallel(model, layout, None)
    pipe, cached = _parallel(model, layout, CacheConfig(kind=kind, threshold=0.0))  # type: ignore[arg-type]
    report = cache_report(pipe)
    assert report is not None and report.num_steps == STEPS and report.skipped == []
    assert all(d is not None for d in report.distances[1:])  # the decision ran on every later step
    assert torch.equal(cached, plain)


def _threshold_between(distances: list[float | None], coefficients: tuple[float, ...] | None) -> float:
    """A threshold that some steps pass and some do not (so both branches are exercised)."""
    values = sorted(
        d if coefficients is None else rescale(coefficients, d) for d in distances if d is not None
    )
    return (values[len(values) // 2 - 1] + values[len(values) // 2]) / 2 if len(values) > 1 else values[0]


@pytest.mark.parametrize(
    "kind,model,layout,compile",
    [
        ("fbc", "flux", "cp2", False),
        ("tea", "flux", "tp2", False),
        ("fbc", "sd3", "tp2", False),
        ("tea", "sd3", "cp2", False),
        pytest.param("fbc", "flux", "tp2", True, marks=pytest.mark.slow),
    ],
)
def test_decisions_equal_the_reference_rule(kind: str, model: str, layout: str, compile: bool) -> None:
    """Record the signals at threshold 0 (every step computed), pick a threshold between the observed distances,
    run again, and compare the skipped steps with the reference rule on the recorded signals of that run."""
    pipe, _ = _parallel(model, layout, CacheConfig(kind=kind, threshold=0.0))  # type: ignore[arg-type]
    probe = cache_report(pipe)
    assert probe is not None
    dt.shutdown()
    coefficients = FLUX_TEA_COEFFICIENTS if (kind == "tea" and model == "flux") else None
    if kind == "tea" and coefficients is None:
        coefficients = (1.0, 0.0)
    threshold = _threshold_between(probe.distances, coefficients if kind == "tea" else None)
    if kind == "tea":
        threshold *= 1.5  # accumulated: allow runs of skips
    cfg = CacheConfig(kind=kind, threshold=threshold, record=True)  # type: ignore[arg-type]
    pipe, _ = _parallel(model, layout, cfg, compile=compile)
    state = cache_state(pipe.transformer)
    report = cache_report(pipe)
    assert state is not None and report is not None
    assert len(state.signals) == STEPS
    if kind == "fbc":
        want = fbc_reference(state.signals, threshold)
    else:
        assert coefficients is not None
        want = tea_reference(state.signals, threshold, coefficients)
    assert report.skipped == want, (report, want)
    assert 0 < len(want) < STEPS - 1, (report, threshold)  # both branches taken


@pytest.mark.parametrize("kind", ["fbc", "tea"])
@pytest.mark.parametrize(
    "model,layout,compile",
    [("flux", "cp2", False), ("sd3", "tp2", False), pytest.param("sd3", "cp2", True, marks=pytest.mark.slow)],
)
def test_skipping_on_a_mesh_equals_the_cache_on_one_device(
    kind: str, model: str, layout: str, compile: bool
) -> None:
    """A forced 50 % skip pattern: the mesh run reuses the cached residuals exactly like the same cache installed on
    the plain single-device transformer."""
    cfg = CacheConfig(kind=kind, force_skip=0.5)  # type: ignore[arg-type]
    ref_pipe = tiny_pipeline(model, sizes=SIZES)
    install_cache(ref_pipe.transformer, cfg, clock=scheduler_clock(ref_pipe.scheduler))
    want = _generate(ref_pipe)
    ref_report = cache_report(ref_pipe)
    pipe, got = _parallel(model, layout, cfg, compile=compile)
    report = cache_report(pipe)
    assert report is not None and ref_report is not None
    assert report.skipped == ref_report.skipped == [1, 3, 5]
    assert psnr(got, want) >= 60.0
    uncached = _generate(tiny_pipeline(model, sizes=SIZES))
    assert psnr(want, uncached) < math.inf  # the skips changed the image: the cached path really ran


def test_generations_restart_the_cache_and_bad_configs_are_refused() -> None:
    pipe, first = _parallel("flux", "cp2", CacheConfig(kind="fbc", force_skip=0.5))
    second = _generate(pipe)
    assert torch.equal(first, second)  # the second call starts from an empty cache
    assert cache_report(pipe).skipped == [1, 3, 5]  # type: ignore[union-attr]
    with pytest.raises(PipelineParallelError, match="kind"):
        CacheConfig(kind="lru")  # type: ignore[arg-type]
    with pytest.raises(PipelineParallelError, match="threshold"):
        CacheConfig.parse("fbc:abc")
    assert CacheConfig.parse("tea:0.4") == CacheConfig(kind="tea", threshold=0.4)
    assert CacheConfig.parse("fbc").resolved_threshold == 0.12


@pytest.mark.parametrize(
    "kind,layout,compile",
    [("fbc", "cp2", False), ("tea", "tp2", False), pytest.param("fbc", "cp2", True, marks=pytest.mark.slow)],
)
def test_one_scalar_fetch_per_step(
    monkeypatch: pytest.MonkeyPatch, kind: str, layout: str, compile: bool
) -> None:
    """The mesh-wide decision costs exactly one fetch per step after the first — of a 0-d value (the distance) —
    plus the one fetch of the final latents per call; no sync."""
    from torch_dtorch.executor.eager import EagerGraphExecutor

    pipe, _ = _parallel("flux", layout, CacheConfig(kind=kind, threshold=0.0), compile=compile)  # type: ignore[arg-type]
    shapes: list[tuple[int, ...]] = []
    syncs: list[int] = []
    fetch, sync = EagerGraphExecutor.fetch, EagerGraphExecutor.sync

    def spy_fetch(self: EagerGraphExecutor, operand: object, *args: object, **kwargs: object) -> object:
        shapes.append(tuple(operand.shape))  # type: ignore[attr-defined]
        return fetch(self, operand, *args, **kwargs)  # type: ignore[arg-type]

    def spy_sync(self: EagerGraphExecutor, *args: object, **kwargs: object) -> None:
        syncs.append(1)
        sync(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(EagerGraphExecutor, "fetch", spy_fetch)
    monkeypatch.setattr(EagerGraphExecutor, "sync", spy_sync)
    _generate(pipe)
    scalars = [s for s in shapes if s == ()]
    assert len(scalars) == STEPS - 1 and len(shapes) == STEPS, shapes  # + the final latents
    assert not syncs
