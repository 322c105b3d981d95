"""Fused ops: each equals its unfused op sequence (diffusers' own functions) bit for bit on the CPU, on every
placement its rule accepts (and after any redistribute the matcher picks), eagerly and compiled on the ``dtorch``
device; on CUDA the per-worker compiled kernels equal the reference."""

from __future__ import annotations

import pytest
import torch

import torch_dtorch as dt
from tests.rules.harness import check_op_samples, check_sample
from tests.rules.samples_fused import SAMPLES
from torch_dtorch.errors import ShapeError
from torch_dtorch.ops.local_kernels import LocalKernel, local_kernel_compile_enabled
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules.families import fused
from torch_dtorch.placement_rules.families.fused import LINEAR_GELU, MODULATE, ROTARY, SILU_LINEAR

R, S, P = Replicate(), Shard, Partial()
OPS = [ROTARY, MODULATE, SILU_LINEAR, LINEAR_GELU]


@pytest.mark.parametrize("op", OPS, ids=str)
def test_every_placement_equals_one_device(op: object) -> None:
    assert check_op_samples(op, SAMPLES[op], limit=30) > 0


def test_references_are_the_unfused_diffusers_code() -> None:
    pytest.importorskip("diffusers")
    from diffusers.models.activations import GELU
    from diffusers.models.embeddings import apply_rotary_emb
    from diffusers.models.normalization import AdaLayerNormZero

    g = torch.Generator().manual_seed(0)
    for seq_dim, shape in ((1, (2, 6, 3, 8)), (2, (2, 3, 6, 8))):
        x, cos, sin = (
            torch.randn(*shape, generator=g),
            torch.randn(6, 8, generator=g),
            torch.randn(6, 8, generator=g),
        )
        want = apply_rotary_emb(x, (cos, sin), sequence_dim=seq_dim)
        assert torch.equal(ROTARY(x, cos, sin, seq_dim), want)
    norm = AdaLayerNormZero(16).eval()
    x, emb = torch.randn(2, 5, 16, generator=g), torch.randn(2, 16, generator=g)
    want_x, *want_rest = norm(x, emb=emb)
    mod = SILU_LINEAR(emb, norm.linear.weight, norm.linear.bias)
    shift, scale, *rest = mod.chunk(6, dim=1)
    assert torch.equal(MODULATE(x, shift, scale, 1e-6), want_x)
    for got, want in zip(rest, want_rest, strict=True):
        assert torch.equal(got, want)
    gelu = GELU(16, 24, approximate="tanh")
    assert torch.equal(LINEAR_GELU(x, gelu.proj.weight, gelu.proj.bias, "tanh"), gelu(x))


def test_rules_keep_the_tensor_parallel_and_sequence_layouts() -> None:
    x, cos, sin = SAMPLES[ROTARY][0].args[:3]
    # sequence-sharded q: the tables are sliced to the device's positions, no gather
    plan = check_sample(ROTARY, SAMPLES[ROTARY][0], (2,), [(S(1),), (R,), (R,)])
    assert plan.match.in_targets == ((S(1),), (S(0),), (S(0),)) and plan.out_placements == ((S(1),),)
    plan = check_sample(ROTARY, SAMPLES[ROTARY][0], (3,), [(S(2),), (R,), (R,)])  # heads (tp / Ulysses)
    assert plan.out_placements == ((S(2),),)
    plan = check_sample(MODULATE, SAMPLES[MODULATE][0], (2,), [(S(1),), (R,), (R,)])
    assert plan.match.in_targets == ((S(1),), (R,), (R,)) and plan.out_placements == ((S(1),),)
    plan = check_sample(LINEAR_GELU, SAMPLES[LINEAR_GELU][0], (2,), [(R,), (S(0),), (S(0),)])
    assert plan.out_placements == ((S(2),),)
    plan = check_sample(SILU_LINEAR, SAMPLES[SILU_LINEAR][0], (2,), [(S(1),), (S(1),), (R,)])
    assert plan.match.in_targets == ((S(1),), (S(1),), (P,)) and plan.out_placements == ((P,),)
    # linear-GELU row parallel would be wrong: a feature-sharded x is gathered (or the weight replicated) first
    plan = check_sample(LINEAR_GELU, SAMPLES[LINEAR_GELU][0], (2,), [(S(2),), (S(1),), (R,)])
    assert plan.out_placements != ((P,),)


def test_on_the_dtorch_device_eager_and_compiled() -> None:
    g = torch.Generator().manual_seed(1)
    q, cos, sin = (
        torch.randn(2, 8, 4, 8, generator=g),
        torch.randn(8, 8, generator=g),
        torch.randn(8, 8, generator=g),
    )
    w, b = torch.randn(12, 8, generator=g), torch.randn(12, generator=g)
    mesh = dt.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    dq = dt.distribute_tensor(q, mesh, [S(1)])
    dcos, dsin = dt.distribute_tensor(cos, mesh, [R]), dt.distribute_tensor(sin, mesh, [R])
    dw, db = dt.distribute_tensor(w, mesh, [R]), dt.distribute_tensor(b, mesh, [R])

    def f(
        q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w: torch.Tensor, b: torch.Tensor
    ) -> torch.Tensor:
        y = torch.ops.dtorch_fused.rotary(q, cos, sin, 1)
        return torch.ops.dtorch_fused.linear_gelu(y, w, b, "tanh")

    want = f(q, cos, sin, w, b)
    y = f(dq, dcos, dsin, dw, db)
    assert y.placements == (S(1),)
    assert torch.equal(y.full_tensor(), want)
    compiled = torch.compile(f, backend="dtorch")
    torch.testing.assert_close(compiled(dq, dcos, dsin, dw, db).full_tensor(), want, atol=0, rtol=0)


def test_bad_shapes_are_refused() -> None:
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(2, 4, 6), mesh, [R])
    bad = dt.distribute_tensor(torch.randn(3, 6), mesh, [R])
    with pytest.raises(ShapeError, match="shift and scale"):
        MODULATE(x, bad, bad, 1e-6)
    with pytest.raises(ShapeError, match="cos and sin"):
        ROTARY(dt.distribute_tensor(torch.randn(1, 4, 2, 6), mesh, [R]), bad, bad, 1)


def test_local_kernels_run_the_reference_on_cpu_and_can_be_turned_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []

    def ref(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.device)
        return x * 2

    k = LocalKernel(ref)
    assert torch.equal(k(torch.ones(2)), torch.full((2,), 2.0)) and calls and not k._compiled
    assert local_kernel_compile_enabled()
    monkeypatch.setenv("DTORCH_LOCAL_KERNEL_COMPILE", "0")
    assert not local_kernel_compile_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (inductor / Triton)")
def test_compiled_cuda_kernels_equal_the_reference() -> None:
    """Each fused op on CUDA bf16 tensors (FLUX-like sizes) runs its inductor-compiled kernel, compiled once per
    device, and equals the reference run eagerly within bf16 rounding."""
    dev = torch.device("cuda", 0)
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g).to(torch.bfloat16)

    cases = [
        (fused._rotary, (r(1, 4608, 24, 128), r(4608, 128).float(), r(4608, 128).float(), 1)),
        (fused._modulate, (r(1, 4096, 3072), r(1, 3072), r(1, 3072), 1e-6)),
        (fused._silu_linear, (r(1, 3072), r(18432, 3072) / 64, r(18432))),
        (fused._linear_gelu, (r(1, 4096, 3072), r(12288, 3072) / 64, r(12288), "tanh")),
    ]
    for kernel, args in cases:
        got = kernel(*args)
        want = kernel.reference(*args)
        assert dev.index in kernel._compiled, kernel
        torch.testing.assert_close(
            got.float(), want.float(), atol=0.05, rtol=0.02, msg=lambda m, k=kernel: f"{k}: {m}"
        )
    # the ops themselves dispatch to the compiled kernels on CUDA
    x, s = r(2, 64, 256), r(2, 256)
    torch.testing.assert_close(
        MODULATE(x, s, s, 1e-6).float(), fused.modulate_reference(x, s, s, 1e-6).float(), atol=0.05, rtol=0.02
    )
