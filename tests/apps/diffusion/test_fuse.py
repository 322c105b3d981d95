"""Fused operators in the pipelines (``ExecuteConfig(fuse=...)``): the fused ops really run on the workers, and the
images equal the unfused ones (bit for bit on one device; to float sums on a mesh) with cp and tp layouts, eager and
compiled; compiled with inductor on the workers, the ops are decomposed into their references (no worker graph calls
one); and every option together (cache + quantization + fusion) on a mesh equals the same options on one device."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, TinySizes, parallelize_pipeline, tiny_pipeline
from torch_dtorch.apps.diffusion.cache import cache_report, install_cache, scheduler_clock
from torch_dtorch.apps.diffusion.config import CacheConfig, FuseConfig, QuantizeConfig
from torch_dtorch.apps.diffusion.fuse import fuse_transformer
from torch_dtorch.apps.diffusion.quantize import quantize_transformer
from torch_dtorch.backend.parity import InductorCapture
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement_rules.families import fused

from .helpers import generate, psnr, reference

pytest.importorskip("diffusers")


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often each fused op's local kernel ran (on any worker)."""
    calls: Counter[str] = Counter()
    for kernel in (fused._rotary, fused._modulate, fused._silu_linear, fused._linear_gelu):
        ref = kernel.reference

        def counted(*args: object, _ref: object = ref, _name: str = kernel.name) -> object:
            calls[_name] += 1
            return _ref(*args)  # type: ignore[operator]

        monkeypatch.setattr(kernel, "reference", counted)
    yield calls


def test_fused_single_device_is_bit_identical() -> None:
    for model in ("flux", "sd3"):
        pipe = tiny_pipeline(model)
        counts = fuse_transformer(pipe.transformer, FuseConfig())
        assert counts["adaln"] >= 3 and counts["linear_gelu"] >= 1
        assert counts.get("rotary", 0) == (2 if model == "flux" else 0)
        assert torch.equal(generate(pipe), reference(model, 1))


@pytest.mark.parametrize(
    "model,sizes,names,compile",
    [
        ("flux", (2,), ("cp",), False),
        ("flux", (2,), ("tp",), False),
        ("sd3", (2, 2), ("tp", "cp"), False),
        pytest.param("flux", (2, 2), ("tp", "cp"), True, marks=pytest.mark.slow),
    ],
)
def test_fused_pipeline_on_a_mesh_equals_unfused(
    model: str, sizes: tuple[int, ...], names: tuple[str, ...], compile: bool, kernel_calls: Counter[str]
) -> None:
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    pipe = parallelize_pipeline(tiny_pipeline(model), mesh, ExecuteConfig(fuse=FuseConfig(), compile=compile))
    got = generate(pipe)
    assert psnr(got, reference(model, 1)) >= 100.0
    assert (
        kernel_calls["modulate"] > 0 and kernel_calls["silu_linear"] > 0 and kernel_calls["linear_gelu"] > 0
    )
    assert (kernel_calls["rotary"] > 0) == (model == "flux")


def test_fuse_flags_select_the_ops(kernel_calls: Counter[str]) -> None:
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    only = FuseConfig(rotary=False, modulate=True, silu_linear=False, linear_gelu=False)
    pipe = parallelize_pipeline(tiny_pipeline("flux"), mesh, ExecuteConfig(fuse=only))
    assert psnr(generate(pipe), reference("flux", 1)) >= 100.0
    assert kernel_calls["modulate"] > 0
    assert kernel_calls["rotary"] == kernel_calls["silu_linear"] == kernel_calls["linear_gelu"] == 0


@pytest.mark.parametrize("model,name", [("flux", "cp"), pytest.param("sd3", "tp", marks=pytest.mark.slow)])
def test_inductor_workers_decompose_the_fused_ops(model: str, name: str, kernel_calls: Counter[str]) -> None:
    """``compile=True`` with ``worker_compiler="inductor"``: each worker's inductor lowers the fused ops'
    references with the rest of its graph (``torch_dtorch/ops/decompositions.py``) — no worker graph calls a
    ``dtorch_fused`` op and no fused kernel runs — and the image is the uncompiled fused run's."""
    torch.compiler.reset()  # dynamo would reuse a transformer forward compiled by an earlier test: no lowering here
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=(name,))
    eager = generate(parallelize_pipeline(tiny_pipeline(model), mesh, ExecuteConfig(fuse=FuseConfig())))
    assert kernel_calls["modulate"] > 0 and kernel_calls["linear_gelu"] > 0  # the ops are installed
    kernel_calls.clear()
    config = ExecuteConfig(fuse=FuseConfig(), compile=True, worker_compiler="inductor")
    pipe = parallelize_pipeline(tiny_pipeline(model), mesh, config)
    with InductorCapture() as cap:
        got = generate(pipe)
    assert cap.graphs
    for graph in cap.graphs:
        called = [op for op in (*graph.ops, *graph.counts.fallback) if "dtorch_fused" in op]
        assert not called, (graph.thread, called)
    assert not kernel_calls, kernel_calls
    assert psnr(got, eager) >= 100.0, psnr(got, eager)
    assert psnr(got, reference(model, 1)) >= 100.0


SIZES = TinySizes(num_layers=2, num_single_layers=2)


@pytest.mark.parametrize(
    "model,sizes,names,compile",
    [
        ("flux", (2,), ("cp",), False),
        ("sd3", (2,), ("tp",), False),
        pytest.param("flux", (2, 2), ("tp", "cp"), True, marks=pytest.mark.slow),
    ],
)
def test_every_option_together_equals_one_device(
    model: str, sizes: tuple[int, ...], names: tuple[str, ...], compile: bool
) -> None:
    cache, quant, fuse = CacheConfig(kind="fbc", force_skip=0.5), QuantizeConfig(kind="int8"), FuseConfig()
    ref = tiny_pipeline(model, sizes=SIZES)
    quantize_transformer(ref.transformer, quant, DeviceMesh.from_shape("cpu", (1,)))
    fuse_transformer(ref.transformer, fuse)
    install_cache(ref.transformer, cache, clock=scheduler_clock(ref.scheduler))
    want = generate(ref)
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    config = ExecuteConfig(cache=cache, quant=quant, fuse=fuse, compile=compile)
    pipe = parallelize_pipeline(tiny_pipeline(model, sizes=SIZES), mesh, config)
    got = generate(pipe)
    assert cache_report(pipe).skipped == cache_report(ref).skipped == [1]  # type: ignore[union-attr]
    assert psnr(got, want) >= 90.0, psnr(got, want)


@pytest.mark.parametrize("model", ["flux", "sd3"])
def test_fused_ops_and_cache_with_ring_context_parallel(model: str, kernel_calls: Counter[str]) -> None:
    """Ring CP keeps q/k sequence-sharded in the joint attention: the rotary rule slices its tables to each device's
    positions; TeaCache at threshold 0 leaves the image as it is."""
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    config = ExecuteConfig(cp_mode="ring", fuse=FuseConfig(), cache=CacheConfig(kind="tea", threshold=0.0))
    pipe = parallelize_pipeline(tiny_pipeline(model), mesh, config)
    assert psnr(generate(pipe), reference(model, 1)) >= 100.0
    assert kernel_calls["modulate"] > 0 and (kernel_calls["rotary"] > 0) == (model == "flux")
