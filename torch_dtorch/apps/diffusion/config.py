"""``ExecuteConfig``: how a parallelized diffusion pipeline executes (context-parallel mode, compilation, VAE,
step cache, quantization, fused operators).

The option dataclasses live here; what they do is in :mod:`~torch_dtorch.apps.diffusion.cache` (``CacheConfig``),
:mod:`~torch_dtorch.apps.diffusion.quantize` (``QuantizeConfig``) and :mod:`~torch_dtorch.apps.diffusion.fuse`
(``FuseConfig``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch_dtorch.errors import PipelineParallelError

__all__ = [
    "CACHE_KINDS",
    "CP_MODES",
    "CacheConfig",
    "CpMode",
    "ExecuteConfig",
    "FuseConfig",
    "QUANT_KINDS",
    "QuantizeConfig",
]

CpMode = Literal["ulysses", "ring", "both"]
CP_MODES: tuple[str, ...] = ("ulysses", "ring", "both")
CacheKind = Literal["fbc", "tea"]
CACHE_KINDS: tuple[str, ...] = ("fbc", "tea")
#: the threshold each cache kind uses when none is given (ParaAttention's FBC default, TeaCache's FLUX "1.5x")
DEFAULT_THRESHOLDS: dict[str, float] = {"fbc": 0.12, "tea": 0.25}
QuantKind = Literal["fp8", "int8"]
QUANT_KINDS: tuple[str, ...] = ("fp8", "int8")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """A step cache of the transformer's blocks (:mod:`~torch_dtorch.apps.diffusion.cache`).

    Args:
        kind: ``"fbc"`` (First-Block Cache: the relative L1 change of the first block's residual against the last
            computed step; below ``threshold`` the remaining blocks are skipped and their cached residual reused) or
            ``"tea"`` (TeaCache: the relative L1 change of the first block's timestep-modulated input, rescaled by
            a polynomial and accumulated; the blocks are skipped while the sum stays below ``threshold``).
        threshold: ``0`` computes every step (exactly the uncached result); ``None``: 0.12 (fbc), 0.25 (tea).
        coefficients: TeaCache's rescaling polynomial, highest power first; ``None``: the published FLUX
            coefficients for FLUX, none (the raw distance) for SD3, which has no published set.
        force_skip: benchmarks only: skip this fraction of the steps (evenly spread, never the first) whatever the
            distance (random weights make thresholds meaningless); the distance is still computed.
        record: keep every step's distance and signal tensor on the host (tests, threshold tuning).
    """

    kind: CacheKind = "fbc"
    threshold: float | None = None
    coefficients: tuple[float, ...] | None = None
    force_skip: float | None = None
    record: bool = False

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise PipelineParallelError(
                f"CacheConfig: kind={self.kind!r} is not one of {list(CACHE_KINDS)}; 'fbc' (First-Block Cache) or "
                "'tea' (TeaCache)"
            )
        if self.threshold is not None and not self.threshold >= 0:
            raise PipelineParallelError(
                f"CacheConfig: threshold={self.threshold} must be >= 0 (0: no caching)"
            )
        if self.force_skip is not None and not 0 <= self.force_skip < 1:
            raise PipelineParallelError(f"CacheConfig: force_skip={self.force_skip} must be in [0, 1)")

    @property
    def resolved_threshold(self) -> float:
        return DEFAULT_THRESHOLDS[self.kind] if self.threshold is None else self.threshold

    @classmethod
    def parse(cls, text: str) -> CacheConfig:
        """``"fbc:0.12"``, ``"tea:0.25"`` or a bare kind (default threshold): the CLI's ``--cache``."""
        kind, _, value = text.partition(":")
        try:
            threshold = float(value) if value else None
        except ValueError:
            raise PipelineParallelError(
                f"--cache {text!r}: the threshold {value!r} is not a number; use e.g. fbc:0.12 or tea:0.25"
            ) from None
        return cls(kind=kind, threshold=threshold)  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class QuantizeConfig:
    """Quantized linears of the transformer (:mod:`~torch_dtorch.apps.diffusion.quantize`).

    Args:
        kind: ``"fp8"`` (e4m3 weights with per-output-channel scales, activations quantized per row at run time,
            ``torch._scaled_mm``: CUDA with compute capability >= 8.9, e.g. Hopper) or ``"int8"`` (weight-only:
            int8 weights with per-output-channel scales, activations unchanged; CPU and CUDA).
        skip: linears left unquantized: names (as in ``named_modules()``) starting with one of these, e.g.
            ``("x_embedder", "proj_out")``. Default: none (every ``nn.Linear`` of the transformer).
        allow_emulation: let ``"fp8"`` run where there is no fp8 GEMM (CPU, older GPUs) with its float emulation —
            the same arithmetic, slower than the float model: for tests only.
    """

    kind: QuantKind = "int8"
    skip: tuple[str, ...] = ()
    allow_emulation: bool = False

    def __post_init__(self) -> None:
        if self.kind not in QUANT_KINDS:
            raise PipelineParallelError(
                f"QuantizeConfig: kind={self.kind!r} is not one of {list(QUANT_KINDS)}; 'fp8' (Hopper) or 'int8'"
            )


@dataclass(frozen=True, kw_only=True)
class FuseConfig:
    """Fused operators in the transformer (:mod:`~torch_dtorch.apps.diffusion.fuse`): each a registered op with its
    own placement rule, compiled per worker on CUDA.

    Args:
        rotary: FLUX's rotary embedding applied to q and k in one op.
        modulate: adaLN modulation ``layer_norm(x) * (1 + scale) + shift`` in one op.
        silu_linear: the modulation projection ``linear(silu(emb))`` (whose output is chunked into shift / scale /
            gate) in one op.
        linear_gelu: the MLP's first layer and its tanh-GELU in one op.
    """

    rotary: bool = True
    modulate: bool = True
    silu_linear: bool = True
    linear_gelu: bool = True


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
        vae_parallel: decode on the mesh (:mod:`~torch_dtorch.apps.diffusion.vae`): the VAE decoder replicated on
            every device, the images — with ``vae_tiling`` every tile of every image — sharded over all of them;
            the same image as diffusers' decode (tiled: diffusers' tiles and blending). Pays from 4 devices at
            1024x1024 with tiling; the text encoders always run on the host device (once per prompt).
        cache: skip transformer blocks on steps whose input barely changed (:class:`CacheConfig`).
        quant: quantized linears (:class:`QuantizeConfig`).
        fuse: fused operators (:class:`FuseConfig`).
    """

    cp_mode: CpMode = "ulysses"
    compile: bool = False
    worker_compiler: Literal["auto", "eager", "inductor"] = "auto"
    cudagraphs: bool = False
    vae_tiling: bool = False
    vae_parallel: bool = False
    cache: CacheConfig | None = None
    quant: QuantizeConfig | None = None
    fuse: FuseConfig | None = None

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
