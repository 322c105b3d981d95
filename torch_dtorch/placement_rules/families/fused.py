"""Fused operators (the seed's ``fused_compile`` family): rotary embedding, adaLN modulation, ``silu``-linear and
linear-GELU, each a registered op with its own placement rule.

Each op's implementation is a :class:`~torch_dtorch.ops.local_kernels.LocalKernel` over a plain-torch reference —
the exact op sequence diffusers runs unfused, so on the CPU the fused op gives the same bits — compiled per
worker with inductor (one Triton kernel, or a GEMM with a fused epilogue) on CUDA. On dtorch tensors the op is one
operator in the graph instead of the 5-15 it replaces, eagerly and inside ``torch.compile(backend="dtorch")``.

Compiled with inductor on the workers (``worker_compiler="inductor"``), each op is decomposed into its reference
before a worker's inductor lowers a graph that calls it (:mod:`torch_dtorch.ops.decompositions`), on every device:
inductor then fuses the reference's arithmetic with the ops around it — the modulation with the residual add that
produced ``x`` and with what consumes it (a pointwise op; under ``QuantizeConfig(kind="fp8")`` the next linear's
row quantization, in one kernel), rotary with q/k's RMS norm, the activations with their GEMM's neighbours —
instead of calling an extern op it cannot fuse into. On CUDA this is the per-worker kernel's own compilation (that
kernel is inductor's lowering of the same reference), fused further; on the CPU it is generated code in place of
the reference's eager aten calls. The compiled result equals the eager op's to float rounding (float32: the
reductions' order). bf16: the eager CPU op (the reference run as is) rounds every intermediate to bf16 — e.g.
``layer_norm(x)``, then ``* (1 + scale)``, then ``+ shift`` — while inductor computes a fused chain in float32 and
rounds once, as the CUDA kernel already does: a few bf16 ulps (the tolerance of the CUDA kernel tests). Tested by
``tests/rules/test_fused_compiled.py``.

- ``dtorch_fused::rotary(x, cos, sin, sequence_dim) -> x'``: diffusers' ``apply_rotary_emb(x, (cos, sin),
  use_real=True, use_real_unbind_dim=-1, sequence_dim=...)`` on a 4-d ``x`` (``[B, S, H, D]`` for
  ``sequence_dim=1``, ``[B, H, S, D]`` for 2), ``cos``/``sin`` ``[S, D]``. Signatures: ``x S(batch)`` or
  ``x S(heads)`` with ``cos, sin R``; ``x S(sequence)`` with ``cos, sin S(0)`` (each device rotates its positions).
- ``dtorch_fused::modulate(x, shift, scale, eps) -> layer_norm(x) * (1 + scale[:, None]) + shift[:, None]``
  (``x [B, S, D]``, ``shift``/``scale`` ``[B, D]``; no affine norm): ``x S(0)`` with ``shift, scale S(0)``;
  ``x S(1)`` with ``shift, scale R``.
- ``dtorch_fused::silu_linear(x, weight, bias?) -> linear(silu(x), weight, bias)``: ``x S(d)`` on a batch dim
  with the weight ``R``; column parallel (weight, bias ``S(0)`` -> ``S(-1)``); row parallel (``x S(-1)``,
  weight ``S(1)``, bias ``P(sum)`` -> ``P(sum)``; ``silu`` is elementwise, so a feature slice is exact).
- ``dtorch_fused::linear_gelu(x, weight, bias?, approximate) -> gelu(linear(x, weight, bias))``: batch dims;
  column parallel (``-> S(-1)``). No row parallel: GELU of a partial sum is not the GELU of the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_dtorch.errors import ShapeError
from torch_dtorch.ops.decompositions import register_inductor_decomposition
from torch_dtorch.ops.local_kernels import LocalKernel
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.rule import register_rule, request_device_kernels
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = [
    "LINEAR_GELU",
    "MODULATE",
    "ROTARY",
    "SILU_LINEAR",
    "linear_gelu_reference",
    "modulate_reference",
    "rotary_reference",
    "silu_linear_reference",
]

_R = Replicate()


# --- references (the unfused op sequences of diffusers) ------------------------------------------------------------


def rotary_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int
) -> torch.Tensor:
    """diffusers' ``apply_rotary_emb`` (``use_real=True``, ``use_real_unbind_dim=-1``)."""
    if sequence_dim == 2:
        cos, sin = cos[None, None, :, :], sin[None, None, :, :]
    else:
        cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x_real, x_imag = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).unbind(-1)  # (empty shards: no -1)
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
    return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def modulate_reference(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' adaLN: ``LayerNorm(D, elementwise_affine=False)(x) * (1 + scale[:, None]) + shift[:, None]``."""
    return F.layer_norm(x, (x.shape[-1],), None, None, eps) * (1 + scale[:, None]) + shift[:, None]


def silu_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The modulation projection: ``linear(silu(x))``."""
    return F.linear(F.silu(x), weight, bias)


def linear_gelu_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> torch.Tensor:
    """diffusers' ``GELU`` activation module: ``gelu(linear(x))``."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


_rotary = LocalKernel(rotary_reference, name="rotary")
_modulate = LocalKernel(modulate_reference, name="modulate")
_silu_linear = LocalKernel(silu_linear_reference, name="silu_linear")
_linear_gelu = LocalKernel(linear_gelu_reference, name="linear_gelu")


# --- the ops ------------------------------------------------------------------------------------------------------


@torch.library.custom_op("dtorch_fused::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """Rotary embedding applied to ``x`` (see the module docstring)."""
    return _rotary(x, cos, sin, sequence_dim)  # type: ignore[no-any-return]


@rotary.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("dtorch_fused::modulate", mutates_args=())
def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """adaLN modulation (see the module docstring)."""
    return _modulate(x, shift, scale, eps)  # type: ignore[no-any-return]


@modulate.register_fake
def _(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = torch.promote_types(x.dtype, torch.promote_types(shift.dtype, scale.dtype))
    return torch.empty_like(x, dtype=dtype)


@torch.library.custom_op("dtorch_fused::silu_linear", mutates_args=())
def silu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(silu(x), weight, bias)``."""
    return _silu_linear(x, weight, bias)  # type: ignore[no-any-return]


@silu_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("dtorch_fused::linear_gelu", mutates_args=())
def linear_gelu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str
) -> torch.Tensor:
    """``gelu(linear(x, weight, bias), approximate=approximate)``."""
    return _linear_gelu(x, weight, bias, approximate)  # type: ignore[no-any-return]


@linear_gelu.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


ROTARY = torch.ops.dtorch_fused.rotary.default
MODULATE = torch.ops.dtorch_fused.modulate.default
SILU_LINEAR = torch.ops.dtorch_fused.silu_linear.default
LINEAR_GELU = torch.ops.dtorch_fused.linear_gelu.default


# --- what inductor traces in their place (compiled programs) ------------------------------------------------------

# Each kernel is its reference (run as is on the CPU, compiled by inductor on CUDA); in a compiled program the worker's
# inductor lowers that reference with the rest of its graph instead (see the module docstring), on every device.
register_inductor_decomposition([ROTARY])(rotary_reference)
register_inductor_decomposition([MODULATE])(modulate_reference)
register_inductor_decomposition([SILU_LINEAR])(silu_linear_reference)
register_inductor_decomposition([LINEAR_GELU])(linear_gelu_reference)


# --- the rules ----------------------------------------------------------------------------------------------------


def _refuse(call: OpCall, expected: str) -> ShapeError:
    described = "\n".join(f"    {t.describe()}" for t in call.present())
    return ShapeError(f"{call.op}: expects {expected}; got\n{described}")


def _check_rotary(call: OpCall) -> None:
    x, cos, sin = call.inputs
    assert x is not None and cos is not None and sin is not None
    seq = call.arg("sequence_dim")
    ok = x.ndim == 4 and seq in (1, 2) and x.shape[-1] % 2 == 0
    if not (ok and cos.shape == sin.shape == (x.shape[seq], x.shape[-1])):
        raise _refuse(call, "a 4-d x with sequence_dim 1 or 2, an even head dim, cos and sin [S, D]")


@register_rule(ROTARY, family="fused", check=_check_rotary)
def rotary_rule(call: OpCall) -> list[PlacementSignature]:
    """Batch or heads sharded: the tables stay whole; sequence sharded: the tables shard with it."""
    seq = call.arg("sequence_dim")
    heads = 2 if seq == 1 else 1
    return [
        sig([Shard(0), _R, _R], Shard(0)),
        sig([Shard(heads), _R, _R], Shard(heads)),
        sig([Shard(seq), Shard(0), Shard(0)], Shard(seq)),
    ]


def _check_modulate(call: OpCall) -> None:
    x, shift, scale = call.inputs
    assert x is not None and shift is not None and scale is not None
    if not (x.ndim == 3 and shift.shape == scale.shape == (x.shape[0], x.shape[2])):
        raise _refuse(call, "x [B, S, D], shift and scale [B, D]")


@register_rule(MODULATE, family="fused", check=_check_modulate)
def modulate_rule(call: OpCall) -> list[PlacementSignature]:
    """The norm reduces over D (never sharded): batch with its shift/scale rows, or tokens with them whole."""
    return [sig([Shard(0), Shard(0), Shard(0)], Shard(0)), sig([Shard(1), _R, _R], Shard(1))]


def _check_linear(call: OpCall) -> None:
    x, w, b = call.inputs
    assert x is not None and w is not None
    if not (w.ndim == 2 and x.shape[-1] == w.shape[1] and (b is None or b.shape == (w.shape[0],))):
        raise _refuse(call, "x [..., K], weight [N, K], bias [N] or None")


def _linear_sigs(call: OpCall, *, row_parallel: bool) -> list[PlacementSignature]:
    x = call.inputs[0]
    assert x is not None
    last = x.ndim - 1
    sigs = [sig([Shard(d), _R, _R], Shard(d)) for d in range(last)]
    sigs.append(sig([_R, Shard(0), Shard(0)], Shard(last)))
    if row_parallel:
        sigs.append(sig([Shard(last), Shard(1), Partial("sum")], Partial("sum")))
    return sigs


@register_rule(SILU_LINEAR, family="fused", check=_check_linear)
def silu_linear_rule(call: OpCall) -> list[PlacementSignature]:
    """Batch dims, column parallel, row parallel (``silu`` is elementwise)."""
    return _linear_sigs(call, row_parallel=True)


@register_rule(LINEAR_GELU, family="fused", check=_check_linear)
def linear_gelu_rule(call: OpCall) -> list[PlacementSignature]:
    """Batch dims and column parallel (GELU after a partial sum would be wrong)."""
    return _linear_sigs(call, row_parallel=False)


request_device_kernels([ROTARY, MODULATE, SILU_LINEAR, LINEAR_GELU])
