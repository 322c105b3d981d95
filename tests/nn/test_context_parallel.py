"""Context-parallel SDPA: ring and Ulysses (and both) selected by sequence-sharded q/k/v on CP-named mesh axes,
compared with single-device torch; causal load balance; no all-gather of k/v; the simulator refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import thread_only
from tests.nn.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.placement_rules.families import context_parallel as cpm
from torch_dtorch.runtime import op_runner as kernel_mod

#: (mesh axis names, sizes, L, S, causal, gqa, mask)
FAST = [
    (("cp",), (3,), 7, 7, True, False, False),
    (("ulysses",), (2,), 8, 8, True, True, False),
    (("ring", "ulysses"), (2, 2), 10, 10, True, True, False),
    (("cp",), (2,), 6, 5, False, False, True),
]
FULL = [
    (("ring",), (4,), 9, 9, True, False, False),
    (("cp",), (4,), 5, 11, False, False, False),
    (("ulysses",), (3,), 7, 7, False, False, True),
    (("ulysses", "ring"), (2, 2), 9, 9, True, False, False),
    (("ulysses", "ring"), (2, 3), 13, 13, True, True, False),
    (("tp", "cp"), (2, 2), 8, 8, True, False, False),
    (("ring", "ulysses"), (2, 2), 10, 10, False, False, True),
    (("cp",), (8,), 5, 5, True, False, False),  # empty shards
]


def _id(case: tuple[object, ...]) -> str:
    names, sizes, q_len, kv_len, causal, gqa, mask = case
    parts = [f"{n}{s}" for n, s in zip(names, sizes)]  # type: ignore[call-overload]
    return "-".join(parts) + f"-L{q_len}S{kv_len}" + "-causal" * causal + "-gqa" * gqa + "-mask" * mask


def run(case: tuple[object, ...]) -> None:
    names, sizes, q_len, kv_len, causal, gqa, use_mask = case
    torch.manual_seed(0)
    heads, kv_heads = 4, (2 if gqa else 4)
    q = torch.randn(2, heads, q_len, 8)
    k, v = torch.randn(2, kv_heads, kv_len, 8), torch.randn(2, kv_heads, kv_len, 6)
    mask = None
    if use_mask:
        mask = torch.rand(2, 1, q_len, kv_len) > 0.3
        mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
    mesh = init_mesh(sizes, mesh_dim_names=names)
    pl = [Shard(1) if n == "tp" else Shard(2) for n in names]  # type: ignore[union-attr]
    qd, kd, vd = (dt.distribute_tensor(t, mesh, pl) for t in (q, k, v))
    md = dt.distribute_tensor(mask, mesh, [Replicate()] * len(pl)) if mask is not None else None
    seen: list[object] = []
    hook = seen.append
    kernel_mod.before_hooks.append(lambda instr, device: hook(type(instr).__name__))
    try:
        out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=md, is_causal=causal, enable_gqa=gqa)
        got = out.full_tensor()
    finally:
        kernel_mod.before_hooks.pop()
    assert out.placements == tuple(pl)
    assert "Redistribute" not in seen  # k/v were never all-gathered: the CP kernel ran on the shards
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", FAST, ids=_id)
def test_cp_attention(case: tuple[object, ...]) -> None:
    run(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", FULL, ids=_id)
def test_cp_attention_full(case: tuple[object, ...]) -> None:
    run(case)


def test_causal_ring_is_load_balanced() -> None:
    """Zig-zag layout: every rank computes about the same number of score elements, about half of L^2 / n."""
    mesh = init_mesh((4,), mesh_dim_names=("cp",))
    q = torch.randn(1, 2, 32, 4)
    qd = dt.distribute_tensor(q, mesh, [Shard(2)])
    cpm.BLOCK_STATS.clear()
    out = F.scaled_dot_product_attention(qd, qd, qd, is_causal=True)
    torch.testing.assert_close(out.full_tensor(), F.scaled_dot_product_attention(q, q, q, is_causal=True))
    work = [cpm.BLOCK_STATS[d] for d in mesh.devices]
    assert max(work) <= 1.25 * min(work), work  # contiguous shards would give 64 vs 256
    assert sum(work) < 0.6 * 32 * 32, work  # masked blocks skipped


def test_no_cp_axis_keeps_allgather_and_simulator_refuses() -> None:
    """Unnamed meshes keep the query-sequence signature; the plain-torch simulator has no communicator."""
    from torch_dtorch.graph import Operand, TensorMeta
    from torch_dtorch.mesh import DeviceMesh
    from torch_dtorch.placement_rules import get_rule
    from torch_dtorch.placement_rules.call import LocalContext, OpCall

    op = torch.ops.aten.scaled_dot_product_attention.default
    for names, has_cp in ((None, False), (("cp",), True)):
        mesh = DeviceMesh.from_shape("cpu", (2,), mesh_dim_names=names)
        x = [Operand(i, (1, 2, 6, 4), torch.float32, mesh, (Shard(2),)) for i in range(3)]
        call = OpCall.make(op, tuple(x), {})
        plan = get_rule(op).plan(call)
        k_target = plan.match.in_targets[1]
        assert (k_target == (Shard(2),)) is has_cp
    assert TensorMeta  # imported for Operand construction
    ctx = LocalContext(
        device=10_000, coordinate=(0,), in_shapes=[], out_shapes=[(1, 2, 3, 4)], out_offsets=[(0,) * 4]
    )
    with pytest.raises(cpm.ContextParallelError, match="no communicator"):
        cpm.run_context_parallel(call, ctx, {"query": torch.zeros(1, 2, 3, 4), "key": None, "value": None})


def _local_inputs(
    names: tuple[str, ...] | None, sizes: tuple[int, ...], batch: int
) -> tuple[dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]], torch.Tensor, torch.Tensor]:
    """Run a sequence-sharded SDPA; return, per device, the (q shape, k shape) of every local attention
    computation the workers ran, the result and the torch reference."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, 4, 16, 8) for _ in range(3))
    mesh = init_mesh(sizes, mesh_dim_names=names)
    qd, kd, vd = (dt.distribute_tensor(t, mesh, [Shard(2)] * len(sizes)) for t in (q, k, v))
    seen: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}

    def hook(device: int, lq: torch.Tensor, lk: torch.Tensor, lv: torch.Tensor) -> None:
        seen.setdefault(device, []).append((tuple(lq.shape), tuple(lk.shape)))

    cpm.local_attention_hooks.append(hook)
    try:
        got = F.scaled_dot_product_attention(qd, kd, vd).full_tensor()
    finally:
        cpm.local_attention_hooks.remove(hook)
    return seen, got, F.scaled_dot_product_attention(q, k, v)


@thread_only
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    ("names", "sizes"), [(("ulysses",), (2,)), (None, (2,)), (None, (4,)), (("ulysses",), (4,))], ids=str
)
def test_ulysses_splits_heads_whatever_the_batch(
    names: tuple[str, ...] | None, sizes: tuple[int, ...], batch: int
) -> None:
    """Sequence-sharded q/k/v: every device attends over the whole sequence with 1/n of the heads (a Ulysses
    axis, or an unnamed mesh where the batch dim is too small to split) — never the batch dim of size 1."""
    seen, got, want = _local_inputs(names, sizes, batch)
    n = sizes[0]
    assert sorted(seen) == list(range(n)), seen
    for shapes in seen.values():
        for q_shape, k_shape in shapes:
            if (
                names is None and batch % n == 0
            ):  # the batch splits evenly: batch-sharded attention is fine too
                assert q_shape in ((batch // n, 4, 16, 8), (batch, 4 // n, 16, 8)), q_shape
            else:
                assert q_shape == (batch, 4 // n, 16, 8) and k_shape == (batch, 4 // n, 16, 8), shapes
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@thread_only
@pytest.mark.parametrize("batch", [1, 2])
def test_ring_keeps_the_sequence_sharded(batch: int) -> None:
    """Ring CP: every device's query blocks hold 1/n of the sequence and all heads; key blocks travel."""
    seen, got, want = _local_inputs(("ring",), (2,), batch)
    assert sorted(seen) == [0, 1], seen
    for shapes in seen.values():
        assert len(shapes) == 2  # one block per ring step
        assert all(q == (batch, 4, 8, 8) and k == (batch, 4, 8, 8) for q, k in shapes), shapes
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_profile_spreads_attention_over_devices() -> None:
    """``dt.profile()``: the attention kernel runs on every device of a Ulysses mesh at batch 1."""
    mesh = init_mesh((2,), mesh_dim_names=("ulysses",))
    qd = dt.distribute_tensor(torch.randn(1, 4, 16, 8), mesh, [Shard(2)])
    with dt.profile() as prof:
        F.scaled_dot_product_attention(qd, qd, qd).full_tensor()
    devices = {s.device for s in prof.spans if "scaled_dot_product_attention" in s.name}
    assert devices == {0, 1}, [(s.device, s.name) for s in prof.spans]
