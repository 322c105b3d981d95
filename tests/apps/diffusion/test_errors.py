"""Bad input to the diffusion app: clear ``PipelineParallelError``s before (or at the first step of) a run."""

from __future__ import annotations

import pytest

import torch_dtorch as dt
from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline, tiny_pipeline
from torch_dtorch.errors import PipelineParallelError

from .helpers import generate

pytest.importorskip("diffusers")


@pytest.mark.parametrize(
    ("model", "sizes", "names", "config", "match"),
    [
        ("flux", (2,), ("dp",), ExecuteConfig(), r"mesh axes \['dp'\].*no meaning"),
        ("flux", (2,), None, ExecuteConfig(), "no axis names"),
        ("flux", (2,), ("cfg",), ExecuteConfig(), "FluxPipeline has no classifier-free-guidance batch"),
        ("flux", (3,), ("cp",), ExecuteConfig(), "4 attention heads.*degree 3 .*does not divide"),
        ("sd3", (2, 4), ("cp", "tp"), ExecuteConfig(), "4 attention heads.*degree 8"),
        ("flux", (2,), ("cp",), ExecuteConfig(cp_mode="both"), "two mesh axes named 'ulysses' and 'ring'"),
        ("flux", (2,), ("ring",), ExecuteConfig(cp_mode="ulysses"), "not ExecuteConfig.cp_mode='ulysses'"),
        ("flux", (2, 2), ("cp", "ring"), ExecuteConfig(cp_mode="ring"), "mix 'cp' with"),
    ],
    ids=[
        "unknown-axis",
        "unnamed",
        "flux-cfg",
        "heads-cp3",
        "heads-cp-tp",
        "both-one-axis",
        "mode-mismatch",
        "mix",
    ],
)
def test_bad_mesh(model: str, sizes: tuple[int, ...], names: tuple[str, ...] | None, config: ExecuteConfig,
                  match: str) -> None:  # fmt: skip
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    pipe = tiny_pipeline(model)
    with pytest.raises(PipelineParallelError, match=match):
        parallelize_pipeline(pipe, mesh, config)


def test_bad_cp_mode() -> None:
    with pytest.raises(PipelineParallelError, match="cp_mode='zigzag' is not one of"):
        ExecuteConfig(cp_mode="zigzag")  # type: ignore[arg-type]


def test_unsupported_pipeline() -> None:
    class SomePipeline:
        transformer = None

    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    with pytest.raises(PipelineParallelError, match="SomePipeline is not supported; supported pipelines"):
        parallelize_pipeline(SomePipeline(), mesh)


def test_sequence_that_does_not_split() -> None:
    """36x36 pixels: 9x9 = 81 FLUX image tokens do not split over 2 devices (checked at the first step)."""
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    pipe = parallelize_pipeline(tiny_pipeline("flux"), mesh)
    with pytest.raises(PipelineParallelError, match="81 image tokens.*degree 2 does not divide"):
        generate(pipe, height=36, width=36)


def test_sd3_tokens_that_do_not_split() -> None:
    """SD3 at 36x36 pixels: 9x9 = 81 patches do not split over 2 devices."""
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    pipe = parallelize_pipeline(tiny_pipeline("sd3"), mesh)
    with pytest.raises(PipelineParallelError, match="81 image tokens.*degree 2 does not divide"):
        generate(pipe, height=36, width=36)


def test_already_parallel() -> None:
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    pipe = parallelize_pipeline(tiny_pipeline("flux"), mesh)
    with pytest.raises(PipelineParallelError, match="already on a mesh"):
        parallelize_pipeline(pipe, mesh)


def test_moving_a_parallel_pipeline() -> None:
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    pipe = parallelize_pipeline(tiny_pipeline("flux"), mesh)
    with pytest.raises(PipelineParallelError, match="cannot be moved.*then call parallelize_pipeline"):
        pipe.to("cpu")
