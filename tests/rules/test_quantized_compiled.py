"""The quantized linears inside compiled programs: the workers' inductor traces their arithmetic (registered
decompositions, ``torch_dtorch/ops/decompositions.py``) instead of calling an opaque op.

fp8 decomposes into the fp8 GEMM formula only where the kernel would run it (CUDA, compute capability >= 8.9);
``DECOMPOSE_FP8_ANYWHERE`` makes the CPU take it too (``torch._scaled_mm`` runs on the CPU), so these tests check on
the CPU what inductor lowers on a Hopper-class GPU: the same numbers as the eager fp8 GEMM path, no call of the
custom op left, one fused quantization kernel with the producer of ``x``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import torch_dtorch as dt
from torch_dtorch import _compat
from torch_dtorch.backend.parity import InductorCapture
from torch_dtorch.errors import ShapeError
from torch_dtorch.ops.decompositions import inductor_decompositions_for
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules.families.quantized import (
    FP8_LINEAR,
    INT8_LINEAR,
    fp8_linear_reference,
    fp8_linear_scaled_mm,
    quantize_weight_fp8,
    quantize_weight_int8,
)

R, S = Replicate(), Shard
_g = torch.Generator().manual_seed(0)
FP8_OP = "dtorch_quant.fp8_linear.default"
SCALED_MM = "aten._scaled_mm.default"


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_g).to(dtype)


def _fp8_block(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """An op producing ``x``, the fp8 linear, a pointwise op after: the shape of a transformer block's linears."""
    return torch.ops.dtorch_quant.fp8_linear(x * 2, q, s, b) * 3


def _norm_fp8(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.dtorch_quant.fp8_linear(F.layer_norm(x, (x.shape[-1],)), q, s, b)


def _fp8_inputs(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    q, s = quantize_weight_fp8(rand(64, 64))
    return rand(2, 8, 64, dtype=dtype), q, s, rand(64, dtype=dtype)


def _want(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """:func:`_fp8_block` with the eager fp8 GEMM path's arithmetic (``torch._scaled_mm`` on the CPU)."""
    return fp8_linear_scaled_mm(x * 2, q, s, b) * 3


def _ops(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _decomposed_ops(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> set[str] | None:
    gm = make_fx(fn)(*args)
    table = inductor_decompositions_for(gm, args)
    return None if table is None else _ops(make_fx(gm, decomposition_table=table)(*args))


def _compile(
    fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, InductorCapture]:
    gm = make_fx(fn)(*args)
    with InductorCapture() as cap:
        compiled = _compat.inductor_compile(
            gm, list(args), decompositions=inductor_decompositions_for(gm, args)
        )
    out = compiled(*args)
    return (out[0] if isinstance(out, (list, tuple)) else out), cap


def test_the_decomposed_graph_calls_scaled_mm_not_the_op(fp8_gemm_on_cpu: None) -> None:
    args = _fp8_inputs()
    ops = _decomposed_ops(_fp8_block, args)
    assert ops is not None and "dtorch_quant.fp8_linear.default" not in ops
    assert {"aten.amax.default", "aten._scaled_mm.default"} <= ops
    # only the ops the graph calls
    assert set(inductor_decompositions_for(make_fx(_fp8_block)(*args), args) or {}) == {FP8_LINEAR}
    q8, s8 = quantize_weight_int8(rand(16, 64))
    int8_args = (args[0], q8, s8, None)
    assert set(inductor_decompositions_for(make_fx(INT8_LINEAR)(*int8_args), int8_args) or {}) == {
        INT8_LINEAR
    }
    # a graph without a registered op: inductor's own table alone, as before
    assert inductor_decompositions_for(make_fx(lambda x: x * 2)(args[0]), args) is None


def test_off_the_fp8_gemm_path_the_op_stays_whole() -> None:
    """On the CPU (no fp8 GEMM) the kernel is the float emulation: no decomposition, the op is called."""
    args = _fp8_inputs()
    assert _decomposed_ops(_fp8_block, args) is None
    got, cap = _compile(_fp8_block, args)
    (graph,) = cap.graphs
    assert graph.ops[FP8_OP] == 1 and graph.ops[SCALED_MM] == 0
    x, q, s, b = args
    torch.testing.assert_close(got, fp8_linear_reference(x * 2, q, s, b) * 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inductor_compiles_the_fp8_gemm_formula(fp8_gemm_on_cpu: None, dtype: torch.dtype) -> None:
    args = _fp8_inputs(dtype)
    got, cap = _compile(_fp8_block, args)
    # the same numbers as the eager fp8 GEMM path (bf16 output rounding included: float32 x is not the reference's)
    torch.testing.assert_close(got, _want(*args), atol=1e-5, rtol=1e-5)
    assert got.dtype == dtype
    (graph,) = cap.graphs
    assert graph.ops[FP8_OP] == 0 and graph.ops[SCALED_MM] == 1
    counts = graph.counts
    assert not any("fp8_linear" in k for k in counts.fallback), counts.fallback
    assert counts.extern["_scaled_mm"] == 1
    # two generated kernels: x * 2 fused with the row quantization (amax, scale, cast), then the * 3 after the GEMM
    assert counts.kernels == 2, graph.code


def test_the_row_quantization_fuses_with_a_layer_norm(fp8_gemm_on_cpu: None) -> None:
    """bf16: inductor quantizes the layer norm's float32 values, not their bf16 rounding (as it fuses any bf16
    chain), so the bits may differ from eager by one e4m3 step on some elements: fp8 error, not more."""
    args = _fp8_inputs()
    got, cap = _compile(_norm_fp8, args)
    (graph,) = cap.graphs
    assert graph.ops[FP8_OP] == 0 and graph.counts.kernels == 1, graph.code
    x, q, s, b = args
    want = fp8_linear_scaled_mm(F.layer_norm(x, (64,)), q, s, b).float()
    assert float((got.float() - want).norm() / want.norm()) < 0.02


def test_the_shape_error_survives_the_decomposition(fp8_gemm_on_cpu: None) -> None:
    q, s = quantize_weight_fp8(rand(12, 64))  # 12 output features: not a multiple of 16
    args = (rand(2, 8, 64, dtype=torch.bfloat16), q, s, rand(12, dtype=torch.bfloat16))
    with pytest.raises(ShapeError, match="divisible by 16"):
        _decomposed_ops(_fp8_block, args)


def test_dtorch_compiled_fp8_runs_the_gemm_formula_in_the_workers(fp8_gemm_on_cpu: None) -> None:
    """``torch.compile(backend="dtorch")`` with inductor on the workers: each rank's graph has the fp8 GEMM, not the
    op, and the result is the eager fp8 GEMM path's (column parallel: every rank quantizes whole rows)."""
    x, q, s, b = _fp8_inputs()
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dx = dt.distribute_tensor(x, mesh, [R])
    dq, ds, db = (dt.distribute_tensor(t, mesh, [S(0)]) for t in (q, s, b))
    compiled = torch.compile(_fp8_block, backend="dtorch", options={"worker_compiler": "inductor"})
    with InductorCapture() as cap:
        got = compiled(dx, dq, ds, db).full_tensor()
    torch.testing.assert_close(got, _want(x, q, s, b), atol=1e-5, rtol=1e-5)
    assert cap.graphs
    assert sum(g.ops[FP8_OP] for g in cap.graphs) == 0
    assert sum(g.ops[SCALED_MM] for g in cap.graphs) == len(cap.graphs)


def test_dtorch_compiled_int8_is_decomposed_and_equals_eager() -> None:
    x, w, b = rand(2, 8, 32), rand(16, 32), rand(16)
    q, s = quantize_weight_int8(w)
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    dx = dt.distribute_tensor(x, mesh, [R])
    dq, ds, db = (dt.distribute_tensor(t, mesh, [S(0)]) for t in (q, s, b))

    def f(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.relu(torch.ops.dtorch_quant.int8_linear(x, q, s, b)) * 2

    compiled = torch.compile(f, backend="dtorch", options={"worker_compiler": "inductor"})
    with InductorCapture() as cap:
        got = compiled(dx, dq, ds, db).full_tensor()
    torch.testing.assert_close(got, f(x, q, s, b))
    assert cap.graphs and sum(g.ops["dtorch_quant.int8_linear.default"] for g in cap.graphs) == 0


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="fp8 GEMM needs sm89+",
)
def test_cuda_inductor_fuses_the_row_quantization_with_its_producer() -> None:
    """On a Hopper-class GPU, without the test switch: the row quantization is one generated kernel with the op
    that produced x, the GEMM is ``_scaled_mm``, and the result is the eager op's within fp8 rounding (bf16 x: the
    fused kernel quantizes unrounded values)."""
    q, s = quantize_weight_fp8(torch.randn(256, 3072, device="cuda"))
    x = torch.randn(4, 128, 3072, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    args = (x, q, s, b)
    got, cap = _compile(_fp8_block, args)
    (graph,) = cap.graphs
    assert graph.ops[FP8_OP] == 0 and graph.ops[SCALED_MM] == 1
    assert graph.counts.kernels <= 2, graph.code
    want = _fp8_block(*args).float()
    assert float((got.float() - want).norm() / want.norm()) < 0.02
