"""The fused ops inside compiled programs: the workers' inductor traces each op's reference (a registered
decomposition, ``torch_dtorch/ops/decompositions.py``) instead of calling an opaque op, and fuses it with the ops
around it.

No call of a ``dtorch_fused`` op is left in the lowered graph; the result equals the eager op (float32: float
rounding; bf16: within the tolerance of the CUDA kernel tests, inductor rounding once where the eager reference
rounds after each op); and the adaLN modulation fuses with its producer and its consumer — a pointwise op, or the
fp8 row quantization of the next linear — into fewer kernels than with the op opaque."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torch_dtorch as dt
from torch_dtorch import _compat
from torch_dtorch.backend.parity import InductorCapture, InductorGraph
from torch_dtorch.ops.decompositions import Decomposition, inductor_decompositions_for
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules.families.fused import (
    LINEAR_GELU,
    MODULATE,
    ROTARY,
    SILU_LINEAR,
    modulate_reference,
)
from torch_dtorch.placement_rules.families.quantized import fp8_linear_scaled_mm, quantize_weight_fp8

R, S = Replicate(), Shard
_g = torch.Generator().manual_seed(0)
Fn = Callable[..., torch.Tensor]
#: the tolerance of the fused ops' bf16 kernel tests (tests/rules/test_fused.py)
BF16_TOL = {"atol": 0.05, "rtol": 0.02}


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_g).to(dtype)


def _rotary_s(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.rotary(x, cos, sin, 1)


def _rotary_h(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.rotary(x, cos, sin, 2)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.modulate(x, shift, scale, 1e-6)


def _silu_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.silu_linear(x, w, b)


def _silu_linear_no_bias(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.silu_linear(x, w, None)


def _linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.linear_gelu(x, w, b, "tanh")


def _linear_gelu_exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.dtorch_fused.linear_gelu(x, w, None, "none")


def _cases(dtype: torch.dtype) -> dict[str, tuple[object, Fn, tuple[torch.Tensor, ...]]]:
    """One call of each op (both rotary layouts; with and without bias) on ``dtype`` activations. FLUX's rotary
    tables are float32 whatever the activations' dtype."""
    return {
        "rotary-seq1": (ROTARY, _rotary_s, (rand(2, 8, 3, 16, dtype=dtype), rand(8, 16), rand(8, 16))),
        "rotary-seq2": (
            ROTARY,
            _rotary_h,
            (rand(2, 3, 8, 16, dtype=dtype), rand(8, 16, dtype=dtype), rand(8, 16, dtype=dtype)),
        ),
        "modulate": (MODULATE, _modulate, (rand(2, 8, 32, dtype=dtype), *(rand(2, 32, dtype=dtype),) * 2)),
        "silu_linear": (
            SILU_LINEAR,
            _silu_linear,
            (rand(2, 32, dtype=dtype), rand(48, 32, dtype=dtype) / 4, rand(48, dtype=dtype)),
        ),
        "silu_linear-no-bias": (
            SILU_LINEAR,
            _silu_linear_no_bias,
            (rand(2, 5, 32, dtype=dtype), rand(48, 32, dtype=dtype) / 4),
        ),
        "linear_gelu": (
            LINEAR_GELU,
            _linear_gelu,
            (rand(2, 8, 32, dtype=dtype), rand(48, 32, dtype=dtype) / 4, rand(48, dtype=dtype)),
        ),
        "linear_gelu-exact": (
            LINEAR_GELU,
            _linear_gelu_exact,
            (rand(2, 8, 32, dtype=dtype), rand(48, 32, dtype=dtype) / 4),
        ),
    }


CASES = list(_cases(torch.float32))


def _fused_ops(ops: Iterable[object]) -> list[str]:
    """The ``dtorch_fused`` ops among ``ops`` (op overloads, or the names inductor's counts use)."""
    return [str(op) for op in ops if "dtorch_fused" in str(op)]


def _compile(
    fn: Fn, args: tuple[torch.Tensor, ...], *, opaque: tuple[object, ...] = ()
) -> tuple[torch.Tensor, InductorGraph]:
    """``fn`` traced and lowered by inductor with the registered decompositions, less those of ``opaque``."""
    gm = make_fx(fn)(*args)
    table = {op: d for op, d in (inductor_decompositions_for(gm, args) or {}).items() if op not in opaque}
    with InductorCapture() as cap:
        compiled = _compat.inductor_compile(gm, list(args), decompositions=table or None)
    out = compiled(*args)
    (graph,) = cap.graphs
    return (out[0] if isinstance(out, (list, tuple)) else out), graph


@pytest.mark.parametrize("case", CASES)
def test_the_decomposed_graph_calls_no_fused_op(case: str) -> None:
    op, fn, args = _cases(torch.float32)[case]
    gm = make_fx(fn)(*args)
    table: dict[object, Decomposition] | None = inductor_decompositions_for(gm, args)
    assert table is not None and set(table) == {op}  # only the ops the graph calls
    decomposed = make_fx(gm, decomposition_table=table)(*args)
    ops = {n.target for n in decomposed.graph.nodes if n.op == "call_function"}
    assert not _fused_ops(ops), decomposed.code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_inductor_compiled_equals_the_eager_op(case: str, dtype: torch.dtype) -> None:
    """float32: float rounding (inductor's reductions and GEMM order). bf16: the eager reference rounds every
    intermediate to bf16 (layer norm, times ``1 + scale``, plus ``shift``), inductor computes the fused chain in
    float32 and rounds once — as the per-worker compiled CUDA kernel does; within the CUDA kernel tests'
    tolerance."""
    _, fn, args = _cases(dtype)[case]
    got, graph = _compile(fn, args)
    assert not _fused_ops(graph.ops) and not _fused_ops(graph.counts.fallback), graph.code
    want = fn(*args)
    assert got.dtype == want.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), **BF16_TOL)


def _residual_modulate(
    x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """A transformer block's residual add, the adaLN modulation of its result, a pointwise op after."""
    h = x + gate[:, None] * y
    return torch.ops.dtorch_fused.modulate(h, shift, scale, 1e-6) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_modulate_fuses_with_its_producer_and_consumer(dtype: torch.dtype) -> None:
    """Opaque: a kernel for the residual add, the op's call, a kernel for the ``* 3``. Decomposed: one kernel."""
    x, y = rand(2, 8, 32, dtype=dtype), rand(2, 8, 32, dtype=dtype)
    args = (x, rand(2, 32, dtype=dtype), y, rand(2, 32, dtype=dtype), rand(2, 32, dtype=dtype))
    got, graph = _compile(_residual_modulate, args)
    _, opaque = _compile(_residual_modulate, args, opaque=(MODULATE,))
    assert opaque.counts.fallback["dtorch_fused.modulate"] == 1 and opaque.counts.kernels == 2, opaque.code
    assert not graph.counts.fallback and graph.counts.kernels == 1, graph.code
    # against float32 math on the same inputs: eager bf16 rounds every intermediate (the residual sum, the
    # modulation before the shift cancels part of it), the fused kernel only its output, so it is the closer one
    want = _residual_modulate(*(a.float() for a in args))
    tol = {} if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got.float(), want, **tol)


def _modulate_fp8(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    q: torch.Tensor,
    s: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """The adaLN modulation of a residual sum feeding an fp8 linear (FLUX's attention input under fp8)."""
    h = torch.ops.dtorch_fused.modulate(x * 2, shift, scale, 1e-6)
    return torch.ops.dtorch_quant.fp8_linear(h, q, s, b)


def test_modulate_fuses_with_the_fp8_row_quantization(fp8_gemm_on_cpu: None) -> None:
    """Opaque modulate: a kernel for ``x * 2``, the op's call, a kernel quantizing its output. Decomposed: one
    kernel (producer, layer norm, modulation, row amax, scale, cast to e4m3), then ``_scaled_mm``. bf16: the fused
    kernel quantizes the modulation's float32 values, not their bf16 rounding — fp8 error, not more."""
    q, s = quantize_weight_fp8(rand(64, 32))
    bf = torch.bfloat16
    args = (rand(2, 8, 32, dtype=bf), rand(2, 32, dtype=bf), rand(2, 32, dtype=bf), q, s, rand(64, dtype=bf))
    got, graph = _compile(_modulate_fp8, args)
    _, opaque = _compile(_modulate_fp8, args, opaque=(MODULATE,))
    assert opaque.counts.fallback["dtorch_fused.modulate"] == 1 and opaque.counts.kernels == 2, opaque.code
    assert graph.counts.kernels == 1 and not graph.counts.fallback, graph.code
    assert graph.counts.extern["_scaled_mm"] == 1
    x, shift, scale = args[:3]
    want = fp8_linear_scaled_mm(modulate_reference(x * 2, shift, scale, 1e-6), q, s, args[5]).float()
    assert float((got.float() - want).norm() / want.norm()) < 0.02


def test_dtorch_compiled_fused_ops_are_decomposed_in_the_workers() -> None:
    """``torch.compile(backend="dtorch")`` with inductor on the workers: sequence-sharded rotary (the tables sliced
    to each rank's positions) into a GELU linear, and a modulation with its projection; no worker graph calls a
    fused op, and the result is the eager op's."""
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    q, cos, sin = rand(2, 8, 4, 8), rand(8, 8), rand(8, 8)
    w, b, emb, pw = rand(12, 32), rand(12), rand(2, 16), rand(64, 16)
    dq = dt.distribute_tensor(q, mesh, [S(1)])
    rest = [dt.distribute_tensor(t, mesh, [R]) for t in (cos, sin, w, b, emb, pw)]

    def f(
        q: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor,
        emb: torch.Tensor,
        pw: torch.Tensor,
    ) -> torch.Tensor:
        y = torch.ops.dtorch_fused.rotary(q, cos, sin, 1).flatten(2)  # [B, S, 32]
        shift, scale = torch.ops.dtorch_fused.silu_linear(emb, pw, None).chunk(2, dim=1)
        y = torch.ops.dtorch_fused.modulate(y + 1, shift, scale, 1e-6)
        return torch.ops.dtorch_fused.linear_gelu(y, w, b, "tanh") * 2

    want = f(q, cos, sin, w, b, emb, pw)
    compiled = torch.compile(f, backend="dtorch", options={"worker_compiler": "inductor"})
    with InductorCapture() as cap:
        out = compiled(dq, *rest)
        got = out.full_tensor()
    assert out.placements == (S(1),)
    torch.testing.assert_close(got, want)
    assert cap.graphs
    for graph in cap.graphs:
        assert not _fused_ops(graph.ops) and not _fused_ops(graph.counts.fallback), graph.code


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor / Triton)")
def test_cuda_decomposed_ops_equal_the_compiled_kernels_and_fuse() -> None:
    """On CUDA (bf16, FLUX-like sizes) the decomposed ops equal the eager op — itself inductor's compilation of the
    same reference — within the kernel tests' tolerance, and the residual add, the modulation and the ``* 3`` after
    are one generated kernel (at most two), fewer launches than with the op opaque."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    cases: list[tuple[Fn, tuple[torch.Tensor, ...]]] = [
        (
            _rotary_s,
            (r(1, 4608, 24, 128), r(4608, 128, dtype=torch.float32), r(4608, 128, dtype=torch.float32)),
        ),
        (_modulate, (r(1, 4096, 3072), r(1, 3072), r(1, 3072))),
        (_silu_linear, (r(1, 3072), r(18432, 3072) / 64, r(18432))),
        (_linear_gelu, (r(1, 4096, 3072), r(12288, 3072) / 64, r(12288))),
    ]
    for fn, args in cases:
        got, graph = _compile(fn, args)
        assert not _fused_ops(graph.ops) and not _fused_ops(graph.counts.fallback), graph.code
        torch.testing.assert_close(got.float(), fn(*args).float(), **BF16_TOL)
    args = (r(1, 4096, 3072), r(1, 3072), r(1, 4096, 3072), r(1, 3072), r(1, 3072))
    got, graph = _compile(_residual_modulate, args)
    _, opaque = _compile(_residual_modulate, args, opaque=(MODULATE,))
    launches = graph.counts.kernels + sum(graph.counts.fallback.values())
    # one kernel expected (a persistent reduction over the 3072 features), two at most
    assert not graph.counts.fallback and graph.counts.kernels <= 2, graph.code
    assert launches < opaque.counts.kernels + sum(opaque.counts.fallback.values()), (graph.code, opaque.code)
    torch.testing.assert_close(got.float(), _residual_modulate(*args).float(), **BF16_TOL)
