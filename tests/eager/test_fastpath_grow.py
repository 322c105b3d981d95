"""Shape-generic templates (``device/fastpath_grow.py``, ``placement_rules/growth.py``): a call at a length the fast
path never saw derives its template from a kept decision of the same growth key — a growing KV-cache ``cat``, a
``[:, -1:]`` slice of a growing tensor, SDPA over a growing cache — instead of planning in full. Values, placements
and strides equal plain torch / the full path at every length; decisions that move a sharded growing dim, or whose
key differs (a full slice, a bucketed length below the mesh size, a mismatched mask), are never reused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import init_mesh
from torch_dtorch import Replicate, Shard
from torch_dtorch.device import fastpath_grow
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.state import get_session
from torch_dtorch.errors import DTorchError
from torch_dtorch.graph import Operand
from torch_dtorch.placement import Placement
from torch_dtorch.placement_rules import OpCall, get_rule
from torch_dtorch.placement_rules.growth import bucket

aten = torch.ops.aten


def _counted(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """``fn()``, the calls it planned in full, the templates it derived."""
    constructor = get_session().executor.constructor
    planned, derived = constructor.num_planned, fastpath_grow.stats["derived"]
    out = fn()
    return out, constructor.num_planned - planned, fastpath_grow.stats["derived"] - derived


def _dist(t: torch.Tensor, mesh: dt.DeviceMesh, pl: list[Placement]) -> torch.Tensor:
    return dt.distribute_tensor(t, mesh, pl)


def _cache_step(
    mesh: dt.DeviceMesh, pl: list[Placement], new_pl: list[Placement], lengths: range
) -> list[int]:
    """``torch.cat([past, new], -2)`` of a ``[2, 4, L, 8]`` cache at each length; values and placements checked.
    Returns the full plans per length."""
    new = torch.randn(2, 4, 1, 8)
    dnew = _dist(new, mesh, new_pl)
    plans = []
    out_pl = None
    for n in lengths:
        past = torch.randn(2, 4, n, 8)
        out, planned, _ = _counted(lambda past=past: torch.cat([_dist(past, mesh, pl), dnew], dim=-2))  # type: ignore[misc]
        assert torch.equal(out.cpu(), torch.cat([past, new], dim=-2))
        assert out_pl is None or out.placements == out_pl, (n, out.placements, out_pl)
        out_pl = out.placements
        plans.append(planned)
    return plans


@pytest.mark.parametrize(
    ("shape", "pl"),
    [
        ((1,), [Replicate()]),
        ((2,), [Shard(0)]),  # batch-sharded (dp)
        ((2,), [Shard(1)]),  # head-sharded (tp)
        ((2, 2), [Shard(0), Shard(1)]),
    ],
    ids=["1", "dp2", "tp2", "dp2xtp2"],
)
def test_growing_cat_plans_once(shape: tuple[int, ...], pl: list[Placement]) -> None:
    mesh = init_mesh(shape)
    plans = _cache_step(mesh, pl, pl, range(3, 11))
    assert plans[0] >= 1 and sum(plans[1:]) == 0, plans


def test_cat_along_a_sharded_dim_reuses_across_uneven_lengths() -> None:
    """Every input sharded on the cat dim: the exchange signature matches as it is at every length, even or odd
    (uneven shards: the rows each rank holds move with the length); the kernel works them out per call."""
    for size in (2, 3):
        mesh = init_mesh((size,))
        plans = _cache_step(mesh, [Shard(2)], [Shard(2)], range(size, size + 7))
        assert sum(plans[1:]) == 0, (size, plans)


def test_cat_that_gathers_a_sharded_growing_dim_is_not_reused() -> None:
    """A past sharded on the cat dim next to a replicated new token: the matcher moves the past, at a cost that
    grows with it — not a free decision, so every length plans in full (and equals torch)."""
    mesh = init_mesh((2,))
    plans = _cache_step(mesh, [Shard(2)], [Replicate()], range(3, 8))
    assert all(p >= 1 for p in plans), plans


@pytest.mark.parametrize("pl", [[Replicate()], [Shard(0)]], ids=["replicate", "shard0"])
def test_growing_last_slice_is_derived_with_torch_strides(pl: list[Placement]) -> None:
    mesh = init_mesh((2,))
    derived_total = 0
    for n in range(4, 12):
        full = torch.arange(2 * n).reshape(2, n)
        x = _dist(full, mesh, pl)
        out, planned, derived = _counted(lambda x=x: x[:, -1:])  # type: ignore[misc]
        ref = full[:, -1:]
        assert operand_of(out).stride == ref.stride() and tuple(out.shape) == tuple(ref.shape)
        assert torch.equal(out.cpu(), ref) and out.placements == x.placements
        if n > 4:
            assert planned == 0, n
        derived_total += derived
    assert derived_total == 7


@pytest.mark.parametrize("mesh_size", [2, 3])
def test_slice_of_a_sharded_growing_dim_is_not_reused(mesh_size: int) -> None:
    """``[:, -1:]`` of a dim sharded unevenly: which rank holds the last element depends on the length; the
    slice's signatures exclude the sliced dim, so the decision moves it — planned in full at every length."""
    mesh = init_mesh((mesh_size,))
    for n in range(1, 8):
        full = torch.arange(2 * n).reshape(2, n)
        out, planned, derived = _counted(lambda full=full: _dist(full, mesh, [Shard(1)])[:, -1:])  # type: ignore[misc]
        assert torch.equal(out.cpu(), full[:, -1:])
        assert derived == 0, n


def test_a_full_slice_is_another_key() -> None:
    """``x[:, 0:8]`` is the whole dim at length 8 (the shard stays) and a real slice at 9 (it moves): the key
    holds whether the slice is full, so the second is planned, not derived."""
    mesh = init_mesh((2,))
    placements = []
    for n in (8, 9):
        full = torch.arange(2 * n).reshape(2, n)
        x = _dist(full, mesh, [Shard(1)])
        out, _, derived = _counted(lambda x=x: aten.slice.Tensor(x, 1, 0, 8))  # type: ignore[misc]
        assert torch.equal(out.cpu(), full[:, 0:8]) and derived == 0
        placements.append(out.placements)
    assert placements[0] == (Shard(1),)


def _sdpa_step(mesh: dt.DeviceMesh, pl: list[Placement], lengths: range, mask: bool = False) -> list[int]:
    q = torch.randn(2, 4, 1, 8)
    dq = _dist(q, mesh, pl)
    plans = []
    for s in lengths:
        k, v = torch.randn(2, 2, s, 8), torch.randn(2, 2, s, 8)
        m = torch.randn(2, 1, 1, s) if mask else None

        def run(k: torch.Tensor = k, v: torch.Tensor = v, m: torch.Tensor | None = m) -> torch.Tensor:
            dm = None if m is None else _dist(m, mesh, [Replicate()] * mesh.ndim)
            dk, dv = _dist(k, mesh, pl), _dist(v, mesh, pl)
            return F.scaled_dot_product_attention(dq, dk, dv, attn_mask=dm, enable_gqa=True)

        out, planned, _ = _counted(run)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
        plans.append(planned)
    return plans


@pytest.mark.parametrize(
    ("shape", "pl"), [((1,), [Replicate()]), ((2,), [Shard(1)]), ((2,), [Shard(0)])], ids=["1", "tp2", "dp2"]
)
@pytest.mark.parametrize("mask", [False, True], ids=["nomask", "mask"])
def test_sdpa_on_a_growing_cache_plans_once(shape: tuple[int, ...], pl: list[Placement], mask: bool) -> None:
    plans = _sdpa_step(init_mesh(shape), pl, range(3, 9), mask=mask)
    assert plans[0] >= 1 and sum(plans[1:]) == 0, plans


def test_sdpa_with_a_mismatched_mask_still_raises() -> None:
    """After a kept decision, a mask whose last dim is neither 1 nor the key length has no growth key: the full
    path runs torch's shape check."""
    mesh = init_mesh((1,))
    _sdpa_step(mesh, [Replicate()], range(3, 5), mask=True)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    m = torch.randn(2, 1, 1, 6)
    with pytest.raises((DTorchError, RuntimeError)):
        out = F.scaled_dot_product_attention(
            *(_dist(t, mesh, [Replicate()]) for t in (q, k, v)),
            attn_mask=_dist(m, mesh, [Replicate()]),
            enable_gqa=True,
        )
        out.cpu()


# --- the keys and the arithmetic, without workers -------------------------------------------------------------------


def _operand(t: torch.Tensor, mesh: dt.DeviceMesh, pl: tuple[Placement, ...], oid: int = 0) -> Operand:
    return Operand(oid, tuple(t.shape), t.dtype, mesh, pl, tuple(t.stride()))


def test_bucket_keeps_what_the_matcher_sees() -> None:
    mesh = init_mesh((4,))
    assert [bucket(n, mesh) for n in range(7)] == [0, 1, 2, 3, 4, 4, 4]
    assert [bucket(n, init_mesh((1,))) for n in range(4)] == [0, 1, 2, 2]


def test_growth_keys_separate_lengths_the_decision_can_see() -> None:
    """Below the mesh size a length can leave ranks empty (the matcher's tie-break): another key; at or above it
    the key is one. Uneven shards share a key (placements, not local lengths, are in it)."""
    mesh = init_mesh((4,))
    rule = get_rule(aten.scaled_dot_product_attention.default)
    pl = (Shard(2),)

    def key(s: int) -> object:
        q, k = torch.empty(2, 4, 1, 8), torch.empty(2, 2, s, 8)
        ops = [_operand(t, mesh, pl, i) for i, t in enumerate((q, k, k))]
        return rule.growth_key(OpCall.make(aten.scaled_dot_product_attention.default, tuple(ops)))

    assert len({key(s) for s in (1, 2, 3, 4)}) == 4
    assert key(4) == key(5) == key(7) == key(8)
    cat = get_rule(aten.cat.default)

    def cat_key(n: int, heads: int = 4) -> object:
        past, new = torch.empty(2, heads, n, 8), torch.empty(2, heads, 1, 8)
        call = OpCall.make(aten.cat.default, ([_operand(past, mesh, pl), _operand(new, mesh, pl, 1)], -2))
        return cat.growth_key(call)

    assert cat_key(5) == cat_key(6) == cat_key(9)
    assert cat_key(0) != cat_key(5) and cat_key(3) != cat_key(5)
    assert cat_key(5, heads=6) != cat_key(5)  # other dims stay exact (another divisibility by the mesh)


@pytest.mark.parametrize("seed", range(4))
def test_grown_meta_equals_shape_inference(seed: int) -> None:
    """The arithmetic of ``grown_meta`` against the rules' meta-tensor inference on random calls."""
    g = torch.Generator().manual_seed(seed)
    mesh = init_mesh((1,))
    pl = (Replicate(),)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (), generator=g))

    for _ in range(20):
        # slice: random dim, bounds (negative, None, past the end), step, on a possibly gapped input
        shape = [rand(1, 6) for _ in range(rand(1, 4))]
        base = torch.empty([n + rand(0, 2) for n in shape])
        t = base[tuple(slice(0, n) for n in shape)]
        dim = rand(-len(shape), len(shape))
        start = [None, rand(-7, 7)][rand(0, 2)]
        end = [None, rand(-7, 9), 2**63 - 1][rand(0, 3)]
        step = rand(1, 4)
        _check_grown(OpCall.make(aten.slice.Tensor, (_operand(t, mesh, pl), dim, start, end, step)))
        # cat of contiguous pieces along one dim
        shape = [rand(1, 4) for _ in range(rand(1, 4))]
        dim = rand(0, len(shape))
        pieces = []
        for i in range(rand(1, 4)):
            s = list(shape)
            s[dim] = rand(0, 5)
            pieces.append(_operand(torch.empty(s), mesh, pl, i))
        _check_grown(OpCall.make(aten.cat.default, (pieces, dim - len(shape) * rand(0, 2))))
        # sdpa at two key lengths of one key (both at least the bucket's cap), maybe a mask broadcast along it
        s1 = rand(2, 9)
        s2 = s1 + rand(1, 5)
        q = torch.empty(2, 4, rand(1, 3), 8)
        which = rand(0, 3)
        calls = []
        for s in (s1, s2):
            k, v = torch.empty(2, 2, s, 8), torch.empty(2, 2, s, 6)
            mask = [None, torch.empty(2, 1, q.shape[2], s), torch.empty(1, 1, q.shape[2], 1)][which]
            ops = [_operand(x, mesh, pl, i) for i, x in enumerate((q, k, v))]
            m = None if mask is None else _operand(mask, mesh, pl, 3)
            calls.append(
                OpCall.make(aten.scaled_dot_product_attention.default, (*ops, m), {"enable_gqa": True})
            )
        _check_grown(calls[1], calls[0])


def _check_grown(call: OpCall, like: OpCall | None = None) -> None:
    """``grown_meta`` of ``call`` given the inferred metadata of ``like`` (a call of the same growth key; default
    ``call`` itself) equals ``call``'s inferred metadata."""
    like = call if like is None else like
    rule = get_rule(call.op)
    want, kept = rule.infer_meta(call), rule.infer_meta(like)
    assert rule.growth_key(call) is not None and rule.growth_key(call) == rule.growth_key(like), call
    got = rule.grown_meta(call, kept)
    assert got is not None and len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert (a.shape, a.dtype, a.stride) == (b.shape, b.dtype, b.stride), (call.op, call.args, a, b)


def _dense(shape: list[int], g: torch.Generator, *, gap: bool) -> torch.Tensor:
    """A contiguous tensor of ``shape`` as torch sees it; with ``gap``, its size-1 dims have other strides (as a
    ``[:, -1:]`` slice of a longer row has)."""
    t = torch.randn(shape, generator=g)
    if not gap:
        return t
    stride = [
        int(torch.randint(2, 40, (), generator=g)) if n == 1 else st for n, st in zip(shape, t.stride())
    ]
    out = t.as_strided(shape, stride)
    assert out.is_contiguous()
    return out


@pytest.mark.parametrize("seed", range(3))
def test_elementwise_and_copy_grown_meta_equals_shape_inference(seed: int) -> None:
    """``generate``'s bookkeeping on the growing ``input_ids`` (``clone``, ``add``, ``isin``): elementwise ops and
    copies over contiguous inputs, broadcasting, derive torch's output strides at another length; one-element
    inputs of any strides (``ids[:, -1:]``) keep theirs through a copy."""
    g = torch.Generator().manual_seed(seed)
    mesh = init_mesh((1,))
    pl = (Replicate(),)

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (), generator=g))

    for _ in range(15):
        nd = rand(1, 4)
        grow = rand(0, nd)
        lens = (rand(2, 6), rand(6, 12))  # two lengths of the growing dim, both at or above the bucket's cap
        shape = [rand(1, 3) for _ in range(nd)]
        bcast = [rand(0, 2) == 0 for _ in range(nd)]
        calls: dict[str, list[OpCall]] = {}
        for n in lens:
            a_shape = [n if d == grow else s for d, s in enumerate(shape)]
            b_shape = [1 if bcast[d] and d != grow else a_shape[d] for d in range(nd)]
            a = _operand(_dense(a_shape, g, gap=False), mesh, pl, 0)
            b = _operand(_dense(b_shape, g, gap=False), mesh, pl, 1)
            one = _operand(_dense([1] * nd, g, gap=True), mesh, pl, 4)  # the same key at every length
            test = _operand(torch.tensor([1.0, 2.0]), mesh, pl, 2)
            cond = _operand(torch.ones(b_shape, dtype=torch.bool), mesh, pl, 3)
            made = {
                "add": OpCall.make(aten.add.Tensor, (a, b)),
                "mul_scalar": OpCall.make(aten.mul.Tensor, (a, 2.0)),
                "neg": OpCall.make(aten.neg.default, (a,)),
                "where": OpCall.make(aten.where.self, (cond, a, b)),
                "isin": OpCall.make(aten.isin.Tensor_Tensor, (a, test)),
                "clone": OpCall.make(aten.clone.default, (a,)),
                "clone_contiguous": OpCall.make(
                    aten.clone.default, (a,), {"memory_format": torch.contiguous_format}
                ),
                "to_copy": OpCall.make(aten._to_copy.default, (a,), {"dtype": torch.float64}),
                "ones_add": OpCall.make(aten.add.Tensor, (one, 1.0)),
                "ones_clone": OpCall.make(aten.clone.default, (one,)),
                "ones_isin": OpCall.make(aten.isin.Tensor_Tensor, (one, test)),
            }
            for name, call in made.items():
                calls.setdefault(name, []).append(call)
        for first, second in calls.values():
            _check_grown(second, first)


def test_a_strided_input_has_no_elementwise_growth_key() -> None:
    mesh = init_mesh((1,))
    t = _operand(torch.randn(4, 6).t(), mesh, (Replicate(),))
    assert get_rule(aten.neg.default).growth_key(OpCall.make(aten.neg.default, (t,))) is None
    assert get_rule(aten.clone.default).growth_key(OpCall.make(aten.clone.default, (t,))) is None
    # a size-1 dim of another stride next to larger dims: torch's output strides follow the inputs' stride order
    g = _operand(torch.randn(4, 1, 2).as_strided((4, 1, 2), (2, 37, 1)), mesh, (Replicate(),))
    assert get_rule(aten.neg.default).growth_key(OpCall.make(aten.neg.default, (g,))) is None
    one = _operand(torch.randn(1, 1).as_strided((1, 1), (35, 1)), mesh, (Replicate(),), 1)
    big = _operand(torch.randn(1, 5), mesh, (Replicate(),), 2)
    assert get_rule(aten.add.Tensor).growth_key(OpCall.make(aten.add.Tensor, (one, big))) is None


@pytest.mark.parametrize("pl", [[Replicate()], [Shard(0)]], ids=["replicate", "shard0"])
def test_generate_bookkeeping_on_growing_ids_plans_once(pl: list[Placement]) -> None:
    """What ``generate`` does to ``input_ids`` each token (``cat`` the new token, ``[:, -1:]``, ``clone``, ``+ 1``,
    ``isin`` against the stop tokens) plans in full at the first lengths only; values equal torch."""
    mesh = init_mesh((2,) if pl == [Shard(0)] else (1,))
    ids = torch.randint(0, 50, (2, 5))
    eos = torch.tensor([3, 7])
    dids, deos = _dist(ids, mesh, pl), dt.distribute_tensor(eos, mesh, [Replicate()])
    plans = []
    for step in range(10):
        new = torch.randint(0, 50, (2, 1))

        def token(new: torch.Tensor = new) -> torch.Tensor:
            nonlocal dids
            dids = torch.cat([dids, _dist(new, mesh, pl)], dim=-1)
            last = dids[:, -1:].clone()
            return torch.isin(dids, deos) & (last + 1 > 0)

        got, planned, _ = _counted(token)
        ids = torch.cat([ids, new], dim=-1)
        assert torch.equal(got.cpu(), torch.isin(ids, eos) & (ids[:, -1:].clone() + 1 > 0)), step
        plans.append(planned)
    assert sum(plans[3:]) == 0, plans
