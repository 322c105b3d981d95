"""Attention under grad on CUDA runs torch's fused kernels where nothing is context parallel
(``placement_rules/families/attention_local.py``).

On the CPU: the glue (argument mapping, ``lse`` shapes, philox placeholders, the mask as a bias) with CPU stand-ins
of the fused ops (``fused_attention_refs.py``) — directly, then through ``loss.backward()`` on 1- and 2-device
meshes, batch / head / query sharded, and a small attention block's training step; gradients against CPU torch.
On a GPU (skipped without one): dtorch's SDPA forward and backward against torch's own fused CUDA ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import thread_only
from tests.training.fused_attention_refs import FusedRefs, emulate_cuda
from torch_dtorch.placement import Placement, Replicate, Shard
from torch_dtorch.placement_rules.families import attention_local as al

BF16 = torch.bfloat16
# bf16 results of the same CPU kernel on the same inputs: exact up to the batch split; float32 likewise
TOL = {BF16: 2e-2, torch.float32: 1e-5}


def _inputs(b: int, h: int, seq: int, e: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, seq, e, generator=g).to(dtype) for _ in range(4)]


# --- the glue, called directly ------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("kernel", "dtype", "masked"),
    [
        (al.Kernel.FLASH, BF16, False),
        (al.Kernel.EFFICIENT, torch.float32, False),
        (al.Kernel.EFFICIENT, BF16, True),
    ],
    ids=["flash", "efficient", "efficient-mask"],
)
def test_glue_equals_the_cpu_pair(
    monkeypatch, kernel: al.Kernel, dtype: torch.dtype, masked: bool, causal: bool
):
    refs = emulate_cuda(monkeypatch)
    q, k, v, dout = _inputs(2, 3, 12, 8, dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # a [B, L, H, E] layout, as projections leave it
    mask = torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) > 0.3 if masked else None
    if mask is not None:
        mask.fill_diagonal_(True)  # no fully masked row
    bias = None if mask is None else torch.zeros(12, 12, dtype=dtype).masked_fill(~mask, float("-inf"))
    want_out, want_lse = al.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=0.3
    )
    want = al.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, want_out, want_lse, 0.0, causal, attn_mask=bias, scale=0.3
    )
    choice = al.Choice(kernel, "test")
    out, lse = al.fused_forward(choice, q, k, v, mask, causal=causal, scale=0.3)
    assert lse.shape == (2, 3, 12) and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    grads = al.fused_backward(choice, dout, q, k, v, out, lse, mask, causal=causal, scale=0.3)
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got, w, atol=TOL[dtype], rtol=TOL[dtype])
    name = kernel.value
    assert refs.calls == {f"{name}_forward": 1, f"{name}_backward": 1}
    assert refs.causal == [causal, causal]


def test_bias_of_a_key_broadcast_mask_is_dense_and_aligned() -> None:
    q, k = torch.zeros(2, 3, 5, 8), torch.zeros(2, 3, 10, 8)
    bias = al._bias(torch.tensor([[True], [False], [True], [True], [True]]), q, k)
    assert bias is not None and bias.shape == (2, 3, 5, 10) and bias.stride(-1) == 1
    assert bias.stride(-2) % al.BIAS_ALIGNMENT == 0
    assert torch.isinf(bias[:, :, 1]).all() and (bias[:, :, 0] == 0).all()


# --- through loss.backward() on dtorch meshes ---------------------------------------------------------------------
def _sdpa_grads(
    tensors: list[torch.Tensor], causal: bool, mask: torch.Tensor | None, mesh=None, pls=None, mask_pl=None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(out, [dq, dk, dv])`` of ``(sdpa(q, k, v) * w).sum()``, in torch or (``mesh``) on dtorch tensors."""
    q, k, v, w = tensors
    if mesh is None:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal)
        (out.float() * w.float()).sum().backward()
        return out.detach(), [t.grad for t in leaves]  # type: ignore[misc]
    leaves = [
        dt.distribute_tensor(t, mesh, pl).requires_grad_() for t, pl in zip((q, k, v), pls, strict=True)
    ]
    dmask = None if mask is None else dt.distribute_tensor(mask, mesh, mask_pl or [Replicate()])
    out = F.scaled_dot_product_attention(*leaves, attn_mask=dmask, is_causal=causal)
    (out.float() * dt.distribute_tensor(w, mesh, pls[0]).float()).sum().backward()
    return out.full_tensor(), [t.grad.full_tensor() for t in leaves]  # type: ignore[union-attr]


def _check(refs: FusedRefs, kernel: str, ranks: int, got, want, dtype: torch.dtype) -> None:
    assert refs.calls == {f"{kernel}_forward": ranks, f"{kernel}_backward": ranks}, refs.calls
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        torch.testing.assert_close(g, w, atol=TOL[dtype], rtol=TOL[dtype])


S0, S1, S2, R = [Shard(0)], [Shard(1)], [Shard(2)], [Replicate()]


@thread_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("dtype", "kernel"), [(BF16, "flash"), (torch.float32, "efficient")], ids=["bf16", "f32"]
)
@pytest.mark.parametrize(("n", "pl"), [(1, R), (2, S0), (2, S1)], ids=["1dev", "batch", "heads"])
def test_sdpa_backward_runs_the_fused_kernels(
    monkeypatch, n: int, pl, dtype, kernel: str, causal: bool
) -> None:
    refs = emulate_cuda(monkeypatch)
    tensors = _inputs(2, 4, 12, 8, dtype, seed=2)
    want = _sdpa_grads(tensors, causal, None)
    mesh = dt.init_device_mesh("cpu", (n,))
    got = _sdpa_grads(tensors, causal, None, mesh, [pl] * 3)
    _check(refs, kernel, n, got, want, dtype)
    assert refs.causal == [causal] * (2 * n)


@thread_only
@pytest.mark.parametrize(
    ("mask_shape", "mask_pl"),
    [((12, 12), R), ((2, 1, 12, 12), S0)],
    ids=["bool-LS-replicated", "float-batch"],
)
def test_a_mask_runs_the_memory_efficient_kernels(monkeypatch, mask_shape, mask_pl) -> None:
    refs = emulate_cuda(monkeypatch)
    tensors = _inputs(2, 4, 12, 8, BF16, seed=3)
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(*mask_shape, generator=g) > 0.3
    mask[..., torch.arange(12), torch.arange(12)] = True
    if len(mask_shape) == 4:  # an additive float mask
        mask = torch.zeros(mask_shape, dtype=BF16).masked_fill(~mask, -1e4)
    want = _sdpa_grads(tensors, False, mask)
    got = _sdpa_grads(tensors, False, mask, dt.init_device_mesh("cpu", (2,)), [S0] * 3, mask_pl)
    _check(refs, "efficient", 2, got, want, BF16)


@thread_only
def test_query_shards_are_fused_unless_causal(monkeypatch) -> None:
    """q sequence-sharded, k/v replicated: non-causal rows are independent (flash on both ranks); causal, the rank
    whose rows start at 0 runs the memory-efficient kernel (its top-left mask is the global one on a non-square
    call), the rank below needs its rows' global offsets (blockwise); equal gradients either way."""
    refs = emulate_cuda(monkeypatch)
    tensors = _inputs(2, 4, 12, 8, BF16, seed=5)
    mesh = dt.init_device_mesh("cpu", (2,))
    got = _sdpa_grads(tensors, False, None, mesh, [S2, R, R])
    _check(refs, "flash", 2, got, _sdpa_grads(tensors, False, None), BF16)
    refs.calls.clear()
    got = _sdpa_grads(tensors, True, None, mesh, [S2, R, R])
    assert refs.calls == {"efficient_forward": 1, "efficient_backward": 1}, refs.calls
    want = _sdpa_grads([t.float() for t in tensors], True, None)
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        torch.testing.assert_close(g.float(), w, atol=3e-2, rtol=3e-2)


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, bias=False)
        self.proj = torch.nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


@thread_only
@pytest.mark.parametrize("n", [1, 2])
def test_attention_block_training_step(monkeypatch, n: int) -> None:
    """One step of a small causal attention block (bf16) with the batch sharded: flash on every rank, the weights'
    gradients equal torch's."""
    refs = emulate_cuda(monkeypatch)
    torch.manual_seed(0)
    ref = _Block(32, 4).to(BF16)
    x = torch.randn(2, 16, 32, dtype=BF16)
    ref(x).float().square().mean().backward()
    mesh = dt.init_device_mesh("cpu", (n,))
    model = _Block(32, 4).to(BF16)
    model.load_state_dict(ref.state_dict())
    for name, p in list(model.named_parameters()):
        mod, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(mod, attr, torch.nn.Parameter(dt.distribute_tensor(p.detach(), mesh, R)))
    model(dt.distribute_tensor(x, mesh, S0)).float().square().mean().backward()
    for (name, p), (_, want) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.full_tensor(), want.grad, atol=2e-2, rtol=2e-2)
    assert refs.calls == {"flash_forward": n, "flash_backward": n}, refs.calls  # (the workers ran: fetched)


# --- on a GPU -----------------------------------------------------------------------------------------------------
def _torch_fused(q, k, v, dout, causal: bool) -> list[torch.Tensor]:
    """torch's flash forward and backward on plain CUDA tensors, called as ops (a plain-CUDA autograd backward
    in a process that imported torch_dtorch hits torch's accelerator conflict: docs/training.md)."""
    a = torch.ops.aten
    o = a._scaled_dot_product_flash_attention.default(q, k, v, 0.0, causal, False)
    out, lse = o[0], o[1]
    grads = a._scaled_dot_product_flash_attention_backward.default(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, o[6], o[7]
    )
    return [out, *grads]


def _spy_fused(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the fused kernels the attention pair's rule kernels call (``flash_forward``, ...)."""
    from torch_dtorch.placement_rules.families import attention_backward as ab

    counts: dict[str, int] = {}
    for name, real in (("forward", al.fused_forward), ("backward", al.fused_backward)):

        def f(choice, *args, _real=real, _name=name, **kwargs):
            key = f"{choice.kernel.value}_{_name}"
            counts[key] = counts.get(key, 0) + 1
            return _real(choice, *args, **kwargs)

        monkeypatch.setattr(ab, f"fused_{name}", f)
    return counts


@thread_only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("dtype", "masked"), [(torch.float32, False), (BF16, True)], ids=["f32", "bf16-mask"]
)
def test_cuda_memory_efficient_sdpa_backward(monkeypatch, dtype: torch.dtype, masked: bool) -> None:
    """The memory-efficient kernels on a simulated 2-device CUDA mesh, batch-sharded (float32; bf16 with a boolean
    mask of 200 keys, not a multiple of the bias alignment; 200 queries, not a multiple of the lse padding): the
    kernels ran, gradients near a float64 CPU reference."""
    counts = _spy_fused(monkeypatch)
    q, k, v, w = (t.to("cuda") for t in _inputs(2, 4, 200, 64, dtype, seed=8))
    mask = None
    if masked:
        mask = torch.rand(200, 200, generator=torch.Generator().manual_seed(9)) > 0.3
        mask.fill_diagonal_(True)
    ref64 = _sdpa_grads([t.cpu().double() for t in (q, k, v, w)], not masked, mask)
    mesh = dt.init_device_mesh("cuda", (2,), simulate=True)
    out, grads = _sdpa_grads([q, k, v, w], not masked, None if mask is None else mask.cuda(), mesh, [S0] * 3)
    assert counts == {"efficient_forward": 2, "efficient_backward": 2}, counts
    tol = 1e-2 if dtype == torch.float32 else 5e-2  # (TF32 matmuls where the kernel uses them)
    for got, r in zip([out, *grads], [ref64[0], *ref64[1]], strict=True):
        torch.testing.assert_close(got.cpu().double(), r, atol=tol, rtol=tol)


@thread_only
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("n", "pl"), [(1, R), (2, S0), (2, S1)], ids=["1dev", "batch", "heads"])
def test_cuda_sdpa_backward_equals_torch_fused(
    monkeypatch, n: int, pl: list[Placement], causal: bool
) -> None:
    """bf16 dtorch SDPA under grad on a (simulated) CUDA mesh: torch's flash kernels ran on every rank (counted),
    forward equal to torch's flash forward, gradients to its backward (and both near a float64 CPU reference)."""
    counts = _spy_fused(monkeypatch)
    q, k, v, w = (t.to("cuda") for t in _inputs(2, 8, 256, 64, BF16, seed=7))
    dout = w.float().to(BF16)  # d(sum(out.float() * w))/d out
    want = _torch_fused(q, k, v, dout, causal)
    ref64 = _sdpa_grads([t.cpu().double() for t in (q, k, v, w)], causal, None)
    mesh = dt.init_device_mesh("cuda", (n,), simulate=n > 1)
    out, grads = _sdpa_grads([q, k, v, w], causal, None, mesh, [pl] * 3)
    assert counts == {"flash_forward": n, "flash_backward": n}, counts
    # the same kernel (its split heuristics aside)
    torch.testing.assert_close(out, want[0], atol=1e-2, rtol=1e-2)
    for got, w_, r in zip(grads, want[1:], ref64[1], strict=True):
        torch.testing.assert_close(got, w_, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.cpu().double(), r, atol=5e-2, rtol=5e-2)
