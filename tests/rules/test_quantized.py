"""Quantized linears (``dtorch_quant::int8_linear``, ``fp8_linear``): every placement the rule accepts equals the op
on one device (exact where the quantization is the same: batch and column shards; row-parallel fp8 quantizes each
slice of a row on its own), the scales travel with their weights, the int8 error against float32 is within its
documented bound, and the ops run on the ``dtorch`` device eagerly and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.rules.harness import Sample, check_op_samples, check_sample
from torch_dtorch.errors import ShapeError
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules.families.quantized import (
    FP8_LINEAR,
    INT8_LINEAR,
    fp8_linear_reference,
    quantize_weight_fp8,
    quantize_weight_int8,
)

R, S, P = Replicate(), Shard, Partial()
_g = torch.Generator().manual_seed(0)

#: documented bound (docs/diffusion.md): relative L2 error of an int8 weight-only linear's output vs float32
INT8_REL_ERROR = 0.01
#: the same for the fp8 linear (e4m3: 3 mantissa bits, on activations and weights)
FP8_REL_ERROR = 0.06


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g)


def _int8_sample(bias: bool = True) -> Sample:
    w = rand(12, 16)
    q, s = quantize_weight_int8(w)
    return Sample((rand(2, 6, 16), q, s, rand(12) if bias else None), atol=1e-4, rtol=1e-4)


def _fp8_sample(bias: bool = True) -> Sample:
    w = rand(12, 16)
    q, s = quantize_weight_fp8(w)
    return Sample((rand(2, 6, 16), q, s, rand(12) if bias else None), atol=1e-4, rtol=1e-4)


def _options(slot: int, t: torch.Tensor) -> list:
    return [R, *[S(d) for d in range(t.ndim)]] + ([P] if slot in (0, 3) and t.is_floating_point() else [])


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_every_placement_equals_one_device(bias: bool) -> None:
    sample = _int8_sample(bias)
    sample.options = _options
    assert check_op_samples(INT8_LINEAR, [sample], limit=40) > 0


def test_tensor_parallel_shards_keep_the_scales_with_the_weights() -> None:
    for op, sample in ((INT8_LINEAR, _int8_sample()), (FP8_LINEAR, _fp8_sample())):
        for mesh in ((2,), (3,)):
            # column parallel: weight rows, their scales and bias on the same shards, no redistribute
            plan = check_sample(op, sample, mesh, [(R,), (S(0),), (S(0),), (S(0),)])
            assert plan.match.in_targets == ((R,), (S(0),), (S(0),), (S(0),))
            assert plan.out_placements == ((S(2),),)
            # batch and sequence shards of x with a replicated weight
            plan = check_sample(op, sample, mesh, [(S(1),), (R,), (R,), (R,)])
            assert plan.out_placements == ((S(1),),)
        # row parallel (int8: exact; fp8: each slice of a row has its own scale, checked against float below)
        plan = check_sample(INT8_LINEAR, _int8_sample(), (2,), [(S(2),), (S(1),), (R,), (R,)])
        assert plan.match.in_targets == ((S(2),), (S(1),), (R,), (P,)) and plan.out_placements == ((P,),)
    # 2-d mesh: batch on one axis, column parallel on the other
    plan = check_sample(INT8_LINEAR, _int8_sample(), (2, 2), [(S(0), R), (R, S(0)), (R, S(0)), (R, S(0))])
    assert plan.out_placements == ((S(0), S(2)),)


def test_int8_error_against_float32_is_within_its_bound() -> None:
    x, w, b = rand(64, 256), rand(192, 256), rand(192)
    want = F.linear(x, w, b)
    q, s = quantize_weight_int8(w)
    got = INT8_LINEAR(x, q, s, b)
    rel = float((got - want).norm() / want.norm())
    assert rel < INT8_REL_ERROR, rel
    assert rel > 1e-4  # the weight really is quantized
    qf, sf = quantize_weight_fp8(w)
    rel8 = float((FP8_LINEAR(x, qf, sf, b) - want).norm() / want.norm())
    assert rel8 < FP8_REL_ERROR, rel8


def test_fp8_row_parallel_is_within_fp8_error() -> None:
    x, w, b = rand(4, 8, 64), rand(32, 64), rand(32)
    q, s = quantize_weight_fp8(w)
    mesh = dt.init_device_mesh("cpu", (2,))
    dx = dt.distribute_tensor(x, mesh, [S(2)])
    dq = dt.distribute_tensor(q, mesh, [S(1)])
    ds, db = dt.distribute_tensor(s, mesh, [R]), dt.distribute_tensor(b, mesh, [R])
    y = FP8_LINEAR(dx, dq, ds, db)
    assert y.placements == (P,)
    want = F.linear(x, w, b)
    rel = float((y.full_tensor() - want).norm() / want.norm())
    assert rel < FP8_REL_ERROR, rel


def test_dtorch_eager_and_compiled_equal_one_device() -> None:
    x, w, b = rand(2, 8, 32), rand(16, 32), rand(16)
    q, s = quantize_weight_int8(w)
    want = INT8_LINEAR(x, q, s, b)
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dx = dt.distribute_tensor(x, mesh, [R])
    dq, ds, db = (dt.distribute_tensor(t, mesh, [S(0)]) for t in (q, s, b))
    y = INT8_LINEAR(dx, dq, ds, db)
    assert y.placements == (S(2),)
    torch.testing.assert_close(y.full_tensor(), want)

    def f(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.ops.dtorch_quant.int8_linear(x, q, s, b)) * 2

    compiled = torch.compile(f, backend="dtorch")
    torch.testing.assert_close(compiled(dx, dq, ds, db).full_tensor(), f(x, q, s, b))


def test_bad_shapes_are_refused() -> None:
    q, s = quantize_weight_int8(rand(12, 16))
    mesh = dt.init_device_mesh("cpu", (2,))
    dx = dt.distribute_tensor(rand(3, 15), mesh, [R])
    dq, ds = dt.distribute_tensor(q, mesh, [R]), dt.distribute_tensor(s, mesh, [R])
    with pytest.raises(ShapeError, match="weight \\[N, K\\]"):
        INT8_LINEAR(dx, dq, ds, None)


def test_fp8_reference_is_the_documented_arithmetic() -> None:
    x, w = rand(5, 32), rand(16, 32)
    q, s = quantize_weight_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    got = fp8_linear_reference(x, q, s, None)
    xs = x.abs().amax(1, keepdim=True) / 448
    want = ((x / xs).to(torch.float8_e4m3fn).float() * xs) @ (q.float() * s[:, None]).t()
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 GEMM needs sm89+",
)
def test_fp8_linear_cuda_kernel_equals_the_reference() -> None:
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w, b = torch.randn(384, 512, device="cuda"), torch.randn(384, device="cuda", dtype=torch.bfloat16)
    q, s = quantize_weight_fp8(w)
    got = FP8_LINEAR(x, q, s, b).float()
    ref = fp8_linear_reference(x.float(), q, s, b.float())
    assert float((got - ref).norm() / ref.norm()) < 0.01  # bf16 output rounding only
