"""Context-parallel attention backward: gradients of q, k, v equal torch's with the sequence sharded.

``_scaled_dot_product_flash_attention_for_cpu`` (attention with its log-sum-exp) and its backward run on the
placement simulator's ranks (a thread per rank, point-to-point messages between them) over meshes whose axis names
pick Ulysses or ring (``placement_rules/families/attention_backward.py``), uneven sequences included; the local
shapes the kernels work on are checked too (ring: ``1/n`` of the sequence, Ulysses: ``1/n`` of the heads). Then
``loss.backward()`` through ``F.scaled_dot_product_attention`` on dtorch tensors (``device/attention_grad.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, Shard
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.families import context_parallel as cpm
from torch_dtorch.placement_rules.families.attention_backward import ATTENTION_BACKWARD, ATTENTION_WITH_LSE
from torch_dtorch.placement_rules.ranks import assemble, coords, distribute, operand_for, run_all_ranks

MESHES = [
    ((2,), ("cp",)),
    ((4,), ("cp",)),
    ((2,), ("ulysses",)),
    ((4,), ("ulysses",)),
    ((2, 2), ("ulysses", "ring")),
]


def _run(op, tensors, kwargs, mesh_shape, names, placements):
    mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape), mesh_dim_names=names)
    ops = [
        None if t is None else operand_for(t, mesh, pl, i)
        for i, (t, pl) in enumerate(zip(tensors, placements))
    ]
    args = [*ops[:-1], 0.0, kwargs.pop("is_causal")]  # tensors, dropout_p, is_causal; the mask by keyword
    call = OpCall.make(op, tuple(args), {"attn_mask": ops[-1], **kwargs}, mesh=mesh)
    rule = get_rule(op)
    plan = rule.plan(call)
    assert plan.match.in_targets[: len(tensors) - 1] == tuple(tuple(p) for p in placements[:-1]), plan.match
    local = {c: [] for c in coords(mesh_shape)}
    for t, pl in zip(tensors, plan.match.in_targets, strict=True):
        shards = distribute(t, mesh_shape, pl) if t is not None else None
        for c in local:
            local[c].append(shards[c] if shards is not None else None)
    kcall = call.retarget(list(call.inputs), list(plan.match.in_targets))
    outs = run_all_ranks(rule, kcall, plan.out_placements, local, mesh_shape)
    return [
        assemble({c: o[i] for c, o in outs.items()}, mesh_shape, pl)
        for i, pl in enumerate(plan.out_placements)
    ], plan


def _inputs(b: int, h: int, seq: int, e: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(b, h, seq, e, generator=g) for _ in range(4))
    return q, k, v, dout


@pytest.mark.parametrize(("mesh_shape", "names"), MESHES, ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq", [12, 11])
def test_cp_forward_and_backward_equal_torch(mesh_shape, names, causal: bool, seq: int) -> None:
    q, k, v, dout = _inputs(2, 4, seq, 8)
    want_out, want_lse = ATTENTION_WITH_LSE(q, k, v, 0.0, causal)
    want = ATTENTION_BACKWARD(dout, q, k, v, want_out, want_lse, 0.0, causal)
    seq_pl = [Shard(2)] * len(mesh_shape)
    lse_pl = [Shard(2)] * len(mesh_shape)
    r = [Replicate()] * len(mesh_shape)
    seen: dict[int, set[tuple[int, ...]]] = {}

    def hook(device: int, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> None:
        seen.setdefault(device, set()).add(tuple(qb.shape))

    cpm.local_attention_hooks.append(hook)
    try:
        (out, lse), _ = _run(
            ATTENTION_WITH_LSE, [q, k, v, None], {"is_causal": causal}, mesh_shape, names, [seq_pl] * 3 + [r]
        )
        grads, plan = _run(
            ATTENTION_BACKWARD,
            [dout, q, k, v, want_out, want_lse, None],
            {"is_causal": causal},
            mesh_shape,
            names,
            [seq_pl] * 5 + [lse_pl, r],
        )
    finally:
        cpm.local_attention_hooks.remove(hook)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)
    assert plan.out_placements == (tuple(seq_pl),) * 3  # gradients stay sequence-sharded
    # the work is divided: Ulysses ranks hold 1/u of the heads, a ring block at most two of the 2·ring zig-zag chunks
    n = math.prod(mesh_shape)
    u = math.prod(s for s, nm in zip(mesh_shape, names, strict=True) if nm == "ulysses")
    assert sorted(seen) == list(range(n))
    for shapes in seen.values():
        for b, h, rows, _ in shapes:
            assert b == 2 and h == 4 // u and rows <= 2 * -(-seq // (2 * (n // u))), shapes


def test_query_sharded_and_batch_sharded_backward_without_cp_axis() -> None:
    """No CP axis: the query rows (dk, dv come out Partial) or the batch split, locally."""
    q, k, v, dout = _inputs(2, 2, 7, 4, seed=1)
    out, lse = ATTENTION_WITH_LSE(q, k, v, 0.0, True)
    want = ATTENTION_BACKWARD(dout, q, k, v, out, lse, 0.0, True)
    s, r = [Shard(2)], [Replicate()]
    pls: list[list[Placement]] = [s, s, r, r, s, s, r]
    grads, plan = _run(
        ATTENTION_BACKWARD, [dout, q, k, v, out, lse, None], {"is_causal": True}, (2,), ("dp",), pls
    )
    assert plan.out_placements[1][0].is_partial()
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)
    b = [Shard(0)]
    grads, _ = _run(
        ATTENTION_BACKWARD, [dout, q, k, v, out, lse, None], {"is_causal": True}, (2,), ("dp",), [b] * 6 + [r]
    )
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got, w, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("sizes", "names"), [((2,), ("cp",)), ((2,), ("ulysses",)), ((4,), ("cp",))], ids=str
)
@pytest.mark.parametrize("causal", [False, True])
def test_loss_backward_through_sdpa_is_context_parallel(sizes, names, causal: bool) -> None:
    """``loss.backward()`` through ``F.scaled_dot_product_attention`` on sequence-sharded dtorch leaves: the
    gradients equal torch's and stay sequence-sharded (the CP backward ran, not a gathered math path)."""
    import torch.nn.functional as F

    import torch_dtorch as dt

    q, k, v, w = _inputs(1, 4, 10, 8, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*leaves, is_causal=causal) * w).sum().backward()
    mesh = dt.init_device_mesh("cpu", sizes, mesh_dim_names=names)
    pl = [Shard(2)] * len(sizes)
    dleaves = [dt.distribute_tensor(t, mesh, pl).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*dleaves, is_causal=causal)
    (out * dt.distribute_tensor(w, mesh, pl)).sum().backward()
    for d, t in zip(dleaves, leaves, strict=True):
        assert d.grad is not None and tuple(d.grad.placements) == tuple(pl)
        torch.testing.assert_close(d.grad.full_tensor(), t.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("names", [("cp",), ("ulysses",)], ids=str)
def test_cuda_simulated_mesh_backward(names) -> None:
    """The same on a simulated 2-device CUDA mesh (every rank on cuda:0), bf16 and float32. The reference runs on
    the CPU in float64 on the same (dtype-rounded) inputs: a plain-CUDA backward in a process that imported
    torch_dtorch hits torch's accelerator conflict (docs/training.md, AcceleratorConflictError)."""
    import torch.nn.functional as F

    import torch_dtorch as dt

    mesh = dt.init_device_mesh("cuda", (2,), mesh_dim_names=names, simulate=True)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 5e-2)):
        q, k, v, w = (t.to("cuda", dtype) for t in _inputs(2, 4, 64, 32, seed=5))
        leaves = [t.cpu().double().requires_grad_() for t in (q, k, v)]
        (F.scaled_dot_product_attention(*leaves, is_causal=True) * w.cpu().double()).sum().backward()
        d = [dt.distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*d, is_causal=True)
        (out.float() * dt.distribute_tensor(w, mesh, [Shard(2)]).float()).sum().backward()
        for got, want in zip(d, leaves, strict=True):
            assert got.grad is not None and tuple(got.grad.placements) == (Shard(2),)
            torch.testing.assert_close(got.grad.full_tensor().cpu().double(), want.grad, atol=tol, rtol=tol)
