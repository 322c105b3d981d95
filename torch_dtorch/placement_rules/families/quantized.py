"""Quantized linears as registered ops: int8 weight-only and fp8 e4m3 with row-wise dynamic activation scales.

``dtorch_quant::int8_linear(x, weight int8 [N, K], scale [N], bias?) -> [..., N]``: ``(x @ weight.T) * scale +
bias`` in ``x``'s dtype — weight-only: the activations stay in their precision, the weight is stored in int8 with
one symmetric scale per output channel (``scale = amax|w_row| / 127``). Runs anywhere (CPU, CUDA).

``dtorch_quant::fp8_linear(x, weight float8_e4m3fn [N, K], scale float32 [N], bias?) -> [..., N]``: each row of
``x`` (each token) is quantized at run time with its own scale (``amax|x_row| / 448``), then one
``torch._scaled_mm`` with the row scales of ``x`` and the per-channel scales of the weight, in ``bfloat16``
(``x``'s dtype on return). The CUDA kernel needs compute capability 8.9+ (Hopper, Ada); on other devices the op
runs an exact float emulation of the same arithmetic (the reference the GPU kernel is tested against), which is
no faster than the float linear: ``QuantizeConfig(kind="fp8")`` refuses meshes that are not Hopper-class.

Signatures (one mesh axis), with the scales sharded with their weights:

- batch: ``x S(d)`` on a non-feature dim, weight/scale/bias ``R`` -> ``S(d)``;
- column parallel: ``x R``, weight ``S(0)``, scale ``S(0)``, bias ``S(0)`` -> ``S(-1)``;
- row parallel: ``x S(-1)``, weight ``S(1)``, scale ``R``, bias ``P(sum)`` -> ``P(sum)`` (a replicated bias
  reaches ``P(sum)`` by a free local zero-fill). For fp8 each rank quantizes its slice of every row with its own
  scale: a finer quantization than the single-device one, not the same bits.

Eagerly the kernels are :class:`~torch_dtorch.ops.local_kernels.LocalKernel`s: compiled per worker on CUDA (the
fp8 activation quantization becomes one Triton kernel before the ``_scaled_mm``), the reference on CPU.

Compiled (``torch.compile(backend="dtorch")`` with inductor on the workers), both ops are decomposed before inductor
lowers a graph that calls them (:mod:`torch_dtorch.ops.decompositions`): fp8, where the kernel would run the fp8
GEMM (CUDA, compute capability >= 8.9), into its row quantization (amax over the last dim, scale, clamp, cast to
e4m3 — generated code fused with whatever produced ``x``: a layer norm, the adaLN modulation, a GELU) and one
``aten._scaled_mm`` with the same arguments as the eager path; elsewhere it stays the opaque op (its float
emulation). int8 into its reference on every device (inductor fuses the weight conversion and the scale / bias
epilogue). Under inductor's fusion a bf16 ``x`` is quantized from its producer's float32 values rather than their
bf16 rounding, as inductor treats any bf16 chain: the bits may differ from eager by one e4m3 step here and there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from torch_dtorch._compat import scaled_mm
from torch_dtorch.errors import ShapeError
from torch_dtorch.ops.decompositions import register_inductor_decomposition
from torch_dtorch.ops.local_kernels import LocalKernel
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.rule import register_rule, request_device_kernels
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = [
    "FP8_MAX",
    "INT8_LINEAR",
    "FP8_LINEAR",
    "fp8_linear_reference",
    "fp8_linear_scaled_mm",
    "fp8_supported",
    "int8_linear_reference",
    "quantize_rows_fp8",
    "quantize_weight_fp8",
    "quantize_weight_int8",
]

_R = Replicate()
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


# --- weight quantization (on the host, once) ----------------------------------------------------------------------


def quantize_weight_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(round(w / s) in [-127, 127], s = amax|w_row| / 127)``; ``s`` in
    ``weight``'s dtype."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel e4m3: ``(w / s as float8_e4m3fn, s = amax|w_row| / 448 as float32)``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_rows_fp8(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise dynamic e4m3 quantization of a ``[M, K]`` activation: ``(x / s, s = amax|x_row| / 448 [M, 1])``."""
    xf = x2d.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


_quantize_rows = LocalKernel(quantize_rows_fp8, name="quantize_rows_fp8")


def fp8_supported(device: torch.device | None = None) -> bool:
    """Whether ``device`` (default: the current CUDA device) runs the fp8 GEMM (compute capability >= 8.9)."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


# --- the ops ------------------------------------------------------------------------------------------------------


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``(x @ weight.T) * scale + bias`` with the int8 weight converted to ``x``'s dtype."""
    y = F.linear(x, weight.to(x.dtype)) * scale.to(x.dtype)
    return y if bias is None else y + bias.to(x.dtype)


_int8_kernel = LocalKernel(int8_linear_reference, name="int8_linear")


@torch.library.custom_op("dtorch_quant::int8_linear", mutates_args=())
def int8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 weight-only linear (see the module docstring)."""
    return _int8_kernel(x, weight, scale, bias)  # type: ignore[no-any-return]


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The fp8 linear's arithmetic in float32: row-quantized ``x`` times the e4m3 weight, both dequantized."""
    x2d = x.reshape(-1, x.shape[-1])
    xq, xs = quantize_rows_fp8(x2d)
    y = (xq.float() * xs) @ (weight.float() * scale.float()[:, None]).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_scaled_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    quantize_rows: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = quantize_rows_fp8,
) -> torch.Tensor:
    """The fp8 GEMM path: ``x``'s rows quantized by ``quantize_rows``, then one ``torch._scaled_mm`` (bf16 output,
    fast accumulation). Plain torch ops: eagerly the CUDA kernel (with the compiled row quantization), traced the
    decomposition inductor lowers (see :func:`_fp8_decomposition`)."""
    n, k = weight.shape
    if k % 16 or n % 16:
        raise ShapeError(
            f"dtorch_quant::fp8_linear: the local weight is [{n}, {k}]; torch._scaled_mm needs both sizes divisible "
            "by 16 (with tensor parallelism: each shard's). Leave this layer unquantized (QuantizeConfig.skip)"
        )
    x2d = x.reshape(-1, k)
    xq, xs = quantize_rows(x2d)
    y = scaled_mm(
        xq,
        weight.contiguous().t(),  # column-major, as the fp8 GEMM wants its second operand
        scale_a=xs,
        scale_b=scale.float().view(1, n),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
        use_fast_accum=True,  # inference: Hopper's fast fp8 accumulation (torchao's forward default)
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


def _quantize_rows_compiled(x2d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _quantize_rows(x2d.contiguous())  # type: ignore[no-any-return]


@torch.library.custom_op("dtorch_quant::fp8_linear", mutates_args=())
def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """fp8 e4m3 linear with row-wise activation scales (see the module docstring)."""
    if x.device.type == "cuda" and fp8_supported(x.device):
        return fp8_linear_scaled_mm(x, weight, scale, bias, _quantize_rows_compiled)
    return fp8_linear_reference(x, weight, scale, bias)


@int8_linear.register_fake
@fp8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


INT8_LINEAR = torch.ops.dtorch_quant.int8_linear.default
FP8_LINEAR = torch.ops.dtorch_quant.fp8_linear.default


# --- what inductor traces in their place (compiled programs) ------------------------------------------------------

#: tests set this to make the compiled path decompose ``fp8_linear`` into the fp8 GEMM formula on any device (the
#: CPU runs ``torch._scaled_mm`` too), so that the CPU suite checks what inductor lowers on a Hopper-class GPU (with
#: inductor's caches off meanwhile: the same graph on the same device is otherwise compiled one way only)
DECOMPOSE_FP8_ANYWHERE = False


def _fp8_decomposes(device: torch.device) -> bool:
    return DECOMPOSE_FP8_ANYWHERE or (device.type == "cuda" and fp8_supported(device))


@register_inductor_decomposition([FP8_LINEAR], when=_fp8_decomposes)
def _fp8_decomposition(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """On a device whose kernel takes the fp8 GEMM path, that path's arithmetic as aten ops: inductor fuses the row
    quantization (amax, scale, clamp, cast) with whatever produced ``x`` and calls ``_scaled_mm``. Elsewhere the op
    stays whole (its float emulation)."""
    return fp8_linear_scaled_mm(x, weight, scale, bias)


# the int8 kernel is its reference on every device (compiled per worker on CUDA): inductor fuses the weight's
# conversion and the scale / bias epilogue with the graph instead
register_inductor_decomposition([INT8_LINEAR])(int8_linear_reference)


# --- the rule -----------------------------------------------------------------------------------------------------


def _check(call: OpCall) -> None:
    x, w, s, b = call.inputs
    assert x is not None and w is not None and s is not None
    ok = w.ndim == 2 and x.shape[-1] == w.shape[1] and s.shape == (w.shape[0],)
    ok = ok and (b is None or b.shape == (w.shape[0],))
    if not ok:
        described = "\n".join(f"    {t.describe()}" for t in call.present())
        raise ShapeError(
            f"{call.op}: expects x [..., K], weight [N, K], scale [N], bias [N] or None; got\n{described}\n"
            "  fix: quantize the weight with quantize_weight_int8 / quantize_weight_fp8 (one scale per output row)"
        )


@register_rule(INT8_LINEAR, FP8_LINEAR, family="quantized", check=_check)
def quantized_linear(call: OpCall) -> list[PlacementSignature]:
    """Batch dims of ``x`` shard freely; column parallel keeps the scales (and bias) with the weight rows; row
    parallel gives ``P(sum)`` (see the module docstring)."""
    x = call.inputs[0]
    assert x is not None
    last = x.ndim - 1
    sigs = [sig([Shard(d), _R, _R, _R], Shard(d)) for d in range(last)]
    sigs.append(sig([_R, Shard(0), Shard(0), Shard(0)], Shard(last)))
    sigs.append(sig([Shard(last), Shard(1), _R, Partial("sum")], Partial("sum")))
    return sigs


request_device_kernels([INT8_LINEAR, FP8_LINEAR])
