"""Quantized linears for the diffusion transformer (``ExecuteConfig(quant=QuantizeConfig(kind=...))``).

Every ``nn.Linear`` of the transformer (except the names in ``QuantizeConfig.skip``) becomes a
:class:`QuantizedLinear` on the host, before the weights move to the mesh: its ``weight`` holds the quantized
values (int8, or float8_e4m3fn) and ``weight_scale`` one scale per output row, both parameters named like the
linear's, so the tensor-parallel plan shards the scales with their weights (column parallel: ``S(0)`` with the
rows; row parallel: replicated, as each scale covers a whole row). The forward calls the registered op
(``dtorch_quant::int8_linear`` / ``fp8_linear``: ``placement_rules/families/quantized.py``), whose placement rule
keeps those layouts, eagerly and inside ``torch.compile(backend="dtorch")``.

- ``int8``: weight-only; the activations keep their dtype. Error: the relative L2 error of a linear's output
  against float32 is below 1 % (per-channel symmetric scales; tested). Runs on CPU and CUDA; it saves memory (half
  of bf16) more than time.
- ``fp8``: e4m3 weights and per-row dynamic activation scales, one ``torch._scaled_mm`` (bf16 output) per linear,
  compute capability 8.9+ (Hopper). Error: below 6 % relative L2 per linear (3 mantissa bits on both operands).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from torch_dtorch.apps.diffusion.config import QuantizeConfig
from torch_dtorch.errors import PipelineParallelError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement_rules.families.quantized import (
    FP8_LINEAR,
    INT8_LINEAR,
    fp8_supported,
    quantize_weight_fp8,
    quantize_weight_int8,
)

__all__ = ["QuantizedLinear", "quantize_transformer"]

log = logging.getLogger(__name__)


class QuantizedLinear(nn.Module):
    """``nn.Linear`` with a quantized ``weight`` ``[out, in]`` and a ``weight_scale`` ``[out]``."""

    def __init__(self, linear: nn.Linear, kind: str) -> None:
        super().__init__()
        quantize = quantize_weight_int8 if kind == "int8" else quantize_weight_fp8
        q, scale = quantize(linear.weight)
        self.kind = kind
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = INT8_LINEAR if self.kind == "int8" else FP8_LINEAR
        return op(x, self.weight, self.weight_scale, self.bias)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


def _check_device(config: QuantizeConfig, mesh: DeviceMesh) -> None:
    if config.kind != "fp8" or config.allow_emulation:
        return
    if mesh.device_type != "cuda" or not fp8_supported():
        where = (
            f"a {mesh.device_type} mesh"
            if mesh.device_type != "cuda"
            else f"CUDA compute capability {torch.cuda.get_device_capability()}"
        )
        raise PipelineParallelError(
            f"QuantizeConfig(kind='fp8'): the fp8 GEMM (torch._scaled_mm, row-wise scales) needs CUDA with compute "
            f"capability >= 8.9 (Hopper, Ada); this is {where}. Use QuantizeConfig(kind='int8') (weight-only, runs "
            "anywhere), or allow_emulation=True for tests"
        )


_DTYPE_CLASSES: dict[type, type] = {}


def _keep_compute_dtype(transformer: nn.Module) -> None:
    """diffusers' ``ModelMixin.dtype`` is the first floating parameter's dtype — after quantization an fp8 weight or
    a float32 scale — and pipelines create their latents and ids in it. The transformer's class becomes a subclass
    (same name) whose ``dtype`` stays the compute dtype it had before."""
    dtype = getattr(transformer, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return
    cls = type(transformer)
    if cls not in _DTYPE_CLASSES:
        _DTYPE_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "dtype": property(lambda self: self._dtorch_compute_dtype),
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            },
        )
    object.__setattr__(transformer, "_dtorch_compute_dtype", dtype)
    transformer.__class__ = _DTYPE_CLASSES[cls]


def quantize_transformer(transformer: nn.Module, config: QuantizeConfig, mesh: DeviceMesh) -> int:
    """Swap ``transformer``'s linears for :class:`QuantizedLinear` (in place, on the host); returns how many. The
    transformer keeps reporting its compute ``dtype``."""
    _check_device(config, mesh)
    _keep_compute_dtype(transformer)
    count = 0
    for name, module in list(transformer.named_modules()):
        if not isinstance(module, nn.Linear) or any(name.startswith(s) for s in config.skip):
            continue
        owner_name, _, leaf = name.rpartition(".")
        owner = transformer.get_submodule(owner_name)
        setattr(owner, leaf, QuantizedLinear(module, config.kind))
        count += 1
    log.info("quantized %d linears to %s", count, config.kind)
    return count
