"""``ExecuteConfig``: how a parallelized diffusion pipeline executes (context-parallel mode, compilation, VAE).

The cache (FirstBlockCache, TeaCache), quantization (fp8 / int8 weight-only) and fusion options of the design
(``CacheConfig``, ``QuantizeConfig``, ``FuseConfig``) are not built yet; they will be fields of this dataclass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch_dtorch.errors import PipelineParallelError

__all__ = ["CP_MODES", "CpMode", "ExecuteConfig"]

CpMode = Literal["ulysses", "ring", "both"]
CP_MODES: tuple[str, ...] = ("ulysses", "ring", "both")


@dataclass(frozen=True, kw_only=True)
class ExecuteConfig:
    """Execution options of :func:`~torch_dtorch.apps.diffusion.parallelize_pipeline`.

    Args:
        cp_mode: context parallelism over the mesh axis ``"cp"``: ``"ulysses"`` (all-to-all sequence -> heads) or
            ``"ring"`` (sequence stays sharded, key/value blocks rotate); ``"both"`` uses two axes named
            ``"ulysses"`` and ``"ring"``. Axes already named ``"ulysses"`` / ``"ring"`` say their mode themselves.
        compile: run the transformer through ``torch.compile(backend="dtorch")`` (one local program per worker).
        worker_compiler: how each worker runs its compiled local program (the ``dtorch`` backend option):
            ``"inductor"``, ``"eager"``, or ``"auto"`` — inductor on CUDA meshes, eager on CPU meshes.
        cudagraphs: CUDA workers capture their inductor-compiled segments in CUDA graphs.
        vae_tiling: decode the latents tile by tile (``AutoencoderKL.enable_tiling``): less memory at large sizes.
    """

    cp_mode: CpMode = "ulysses"
    compile: bool = False
    worker_compiler: Literal["auto", "eager", "inductor"] = "auto"
    cudagraphs: bool = False
    vae_tiling: bool = False

    def compile_options(self, device_type: str) -> dict[str, str | int | bool | Callable[..., Any]]:
        """The ``options`` of ``torch.compile(backend="dtorch")`` for a mesh of ``device_type``."""
        wc = self.worker_compiler
        if wc == "auto":
            wc = "inductor" if device_type == "cuda" else "eager"
        return {"worker_compiler": wc, "cudagraphs": self.cudagraphs}

    def __post_init__(self) -> None:
        if self.cp_mode not in CP_MODES:
            raise PipelineParallelError(
                f"ExecuteConfig: cp_mode={self.cp_mode!r} is not one of {list(CP_MODES)}; use 'ulysses' or "
                "'ring' with a mesh axis 'cp', or 'both' with two axes 'ulysses' and 'ring'"
            )
