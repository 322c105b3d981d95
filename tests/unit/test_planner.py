"""Redistribute planner: property tests against the plain-torch simulator, local shape math, goldens, regressions."""

from __future__ import annotations

import math

import pytest
import torch
from expecttest import TestCase
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from torch_dtorch.errors import RedistributeError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    local_shape_and_offset,
    parse_placements,
    placements_str,
)
from torch_dtorch.placement_rules.ranks import assemble, coords, distribute
from torch_dtorch.placement_rules.redistribute.planner import plan_on_mesh, plan_redistribute
from torch_dtorch.placement_rules.redistribute.simulate import apply_plan, apply_step
from torch_dtorch.placement_rules.redistribute.steps import AllGather, AxisStep, PointToPoint, ReduceScatter

SETTINGS = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
SETTINGS_SMALL = settings(SETTINGS, max_examples=100)
OPS = ("sum", "avg", "max", "min")
R = Replicate()


# --- strategies ---------------------------------------------------------------------------------------------------


def placement(ndim: int, *, partial: bool = True) -> st.SearchStrategy[Placement]:
    options: list[st.SearchStrategy[Placement]] = [st.just(R), st.builds(Shard, st.integers(0, ndim - 1))]
    if partial:
        options.append(st.builds(Partial, st.sampled_from(OPS)))
    return st.one_of(*options)


@st.composite
def layout_case(draw: st.DrawFn, *, partial: bool = True) -> tuple:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=1, max_size=3)))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    pl = st.tuples(*(placement(len(shape), partial=partial) for _ in mesh_shape))
    return shape, mesh_shape, draw(pl), draw(pl), draw(st.integers(0, 2**31 - 1))


# --- helpers ------------------------------------------------------------------------------------------------------


def _global(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64), gen


def _inexact(placements: tuple[Placement, ...]) -> bool:
    """Random sum/avg partial splits do not add back bit-exactly; max/min splits do."""
    return any(isinstance(p, Partial) and p.reduce_op in ("sum", "avg") for p in placements)


def _same_bytes(a, b, mesh_shape) -> bool:
    """Equal placements on every axis of size > 1 (a size-1 axis holds the whole tensor whatever it says)."""
    return all(x == y for x, y, n in zip(a, b, mesh_shape) if n > 1)


def _check_chain(plan, src, dst) -> None:
    """Steps chain from ``src`` to ``dst``; size-1 axes get no step (their placements are relabelled freely)."""
    cur, shape = tuple(src), plan.src_mesh.root.shape
    for step, mesh_shape in zip(plan.steps, plan.mesh_shapes()):
        assert _same_bytes(step.placements_before, cur, mesh_shape), (str(plan), step)
        if isinstance(step, AxisStep):
            changed = [
                i for i, (a, b) in enumerate(zip(step.placements_before, step.placements_after)) if a != b
            ]
            assert changed == [step.axis], (str(plan), step)
            assert mesh_shape[step.axis] > 1, (str(plan), step)
        else:
            assert isinstance(step, PointToPoint)
        cur = step.placements_after
        shape = step.dst_mesh_shape if isinstance(step, PointToPoint) else mesh_shape
    assert _same_bytes(cur, tuple(dst), shape), str(plan)


def _check_result(out, x, dst_mesh_shape, src, dst) -> None:
    if any(isinstance(p, Partial) for p in dst):
        torch.testing.assert_close(assemble(out, dst_mesh_shape, dst), x)
        return
    want = distribute(x, dst_mesh_shape, dst)
    assert set(out) == set(want)
    for c, t in want.items():
        assert out[c].shape == t.shape, (c, out[c].shape, t.shape)
        if _inexact(src):
            torch.testing.assert_close(out[c], t)
        else:
            assert torch.equal(out[c], t), c
    assemble(out, dst_mesh_shape, dst)  # replicas agree exactly


# --- property tests -----------------------------------------------------------------------------------------------


@SETTINGS
@given(layout_case())
def test_plan_matches_simulation(case) -> None:
    shape, mesh_shape, src, dst, seed = case
    mesh = DeviceMesh.from_shape("cpu", mesh_shape)
    plan = plan_redistribute(shape, mesh, src, dst_placements=dst)
    _check_chain(plan, src, dst)
    x, gen = _global(shape, seed)
    out = apply_plan(plan, distribute(x, mesh_shape, src, gen=gen), shape)
    _check_result(out, x, mesh_shape, src, dst)
    assert plan.comm_bytes(8) >= 0


@SETTINGS_SMALL
@given(layout_case(), st.data())
def test_plan_between_submesh_views(case, data) -> None:
    shape, mesh_shape, src_root, dst_root, seed = case
    names = tuple(f"a{i}" for i in range(len(mesh_shape)))
    root = DeviceMesh.from_shape("cpu", mesh_shape, mesh_dim_names=names)
    views = []
    for pl in (src_root, dst_root):
        axes = data.draw(st.lists(st.sampled_from(range(len(names))), min_size=1, unique=True))
        view = root[tuple(names[a] for a in axes)]
        views.append(
            (view, tuple(pl[a] for a in axes), tuple(pl[a] if a in axes else R for a in range(len(names))))
        )
    (src_view, src, src_full), (dst_view, dst, dst_full) = views
    plan = plan_redistribute(shape, src_view, src, dst_view, dst)
    assert plan.src_placements == src_full and plan.dst_placements == dst_full
    _check_chain(plan, src_full, dst_full)
    x, gen = _global(shape, seed)
    out = apply_plan(plan, distribute(x, mesh_shape, src_full, gen=gen), shape)
    _check_result(out, x, mesh_shape, src_full, dst_full)


@SETTINGS_SMALL
@given(layout_case(), st.lists(st.integers(1, 3), min_size=1, max_size=3), st.booleans(), st.data())
def test_cross_mesh_plan(case, dst_mesh_shape, same, data) -> None:
    shape, src_mesh_shape, src, _, seed = case
    if same:
        dst_mesh_shape, dst = src_mesh_shape, src
    else:
        dst = data.draw(st.tuples(*(placement(len(shape)) for _ in dst_mesh_shape)))
    n_src = math.prod(src_mesh_shape)
    src_mesh = DeviceMesh.from_shape("cpu", src_mesh_shape)
    dst_mesh = DeviceMesh(
        "cpu", torch.arange(n_src, n_src + math.prod(dst_mesh_shape)).reshape(dst_mesh_shape)
    )
    plan = plan_redistribute(shape, src_mesh, src, dst_mesh, dst)
    _check_chain(plan, src, dst)
    p2p = [s for s in plan.steps if isinstance(s, PointToPoint)]
    assert len(p2p) == 1 and plan.cross_mesh
    if same:
        assert plan.steps == tuple(p2p)
    assert {d for _, d in p2p[0].pairs} == set(range(n_src, n_src + math.prod(dst_mesh_shape)))
    x, gen = _global(shape, seed)
    out = apply_plan(plan, distribute(x, src_mesh_shape, src, gen=gen), shape)
    _check_result(out, x, tuple(dst_mesh_shape), src, dst)


@SETTINGS
@given(layout_case())
def test_local_shape_and_offset(case) -> None:
    shape, mesh_shape, pl, _, seed = case
    x, gen = _global(shape, seed)
    shards = distribute(x, mesh_shape, pl, gen=gen)
    has_partial = any(isinstance(p, Partial) for p in pl)
    rebuilt = torch.zeros(shape, dtype=x.dtype)
    for c in coords(mesh_shape):
        local, offset = local_shape_and_offset(shape, mesh_shape, pl, c)
        assert tuple(shards[c].shape) == local
        up_shape, up_offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(c), pl)
        assert tuple(up_shape) == local
        assert tuple(up_offset) == offset  # empty shards included: offset = end of the dim, as upstream
        if not has_partial:
            region = tuple(slice(o, o + s) for o, s in zip(offset, local))
            assert torch.equal(x[region], shards[c])
            rebuilt[region] = shards[c]
    if not has_partial:
        assert torch.equal(rebuilt, x)


# --- regressions: nesting and partial ordering --------------------------------------------------------------------


def _run(text_src: str, text_dst: str, shape=(5, 7), mesh_shape=(2, 3), seed=0) -> str:
    src, dst = parse_placements(text_src), parse_placements(text_dst)
    mesh = DeviceMesh.from_shape("cpu", mesh_shape)
    plan = plan_redistribute(shape, mesh, src, dst_placements=dst)
    _check_chain(plan, src, dst)
    x, gen = _global(shape, seed)
    _check_result(apply_plan(plan, distribute(x, mesh_shape, src, gen=gen), shape), x, mesh_shape, src, dst)
    return "; ".join(str(s) for s in plan.steps)


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        # a later axis sharding the same dim must be gathered before the earlier axis changes, then re-sliced
        (
            "S(0)S(0)",
            "S(1)S(0)",
            "all_gather(axis=1, dim=0); all_to_all(axis=0, 0->1); local_slice(axis=1, dim=0)",
        ),
        (
            "S(0)S(0)",
            "RS(0)",
            "all_gather(axis=1, dim=0); all_gather(axis=0, dim=0); local_slice(axis=1, dim=0)",
        ),
        (
            "RS(0)",
            "S(0)S(0)",
            "all_gather(axis=1, dim=0); local_slice(axis=0, dim=0); local_slice(axis=1, dim=0)",
        ),
        # reduce-scatter on the outer axis first, then the inner one splits its chunk: no all-reduce needed
        (
            "P(sum)P(sum)",
            "S(0)S(0)",
            "reduce_scatter(axis=0, op=sum, dim=0); reduce_scatter(axis=1, op=sum, dim=0)",
        ),
        # max over sums: the inner sum must be reduced before the outer max
        ("P(max)P(sum)", "RR", "all_reduce(axis=1, op=sum); all_reduce(axis=0, op=max)"),
        (
            "P(max)P(sum)",
            "RP(sum)",
            "all_reduce(axis=1, op=sum); all_reduce(axis=0, op=max); zero_fill(axis=1, op=sum)",
        ),
        # sum and avg commute: no need to touch axis 1
        ("P(sum)P(avg)", "S(1)P(avg)", "reduce_scatter(axis=0, op=sum, dim=1)"),
        ("P(max)R", "P(sum)R", "all_reduce(axis=0, op=max); zero_fill(axis=0, op=sum)"),
        ("S(1)R", "P(avg)R", "all_gather(axis=0, dim=1); zero_fill(axis=0, op=avg)"),
        # on a 2x3 mesh gathering over the smaller axis 0 is cheaper; axis 1 then may all-to-all (nothing later)
        (
            "S(1)S(0)",
            "S(0)S(1)",
            "all_gather(axis=0, dim=1); all_to_all(axis=1, 0->1); local_slice(axis=0, dim=0)",
        ),
    ],
)
def test_nesting_regressions(src: str, dst: str, expected: str) -> None:
    assert _run(src, dst) == expected
    assert _run(src, dst, shape=(1, 2)) == expected  # plans do not depend on the shape; empty shards here


def test_every_pair_on_a_2x3_mesh() -> None:
    """Exhaustive complement to the property tests: every src/dst pair of a small placement set, uneven shards."""
    options = [R, Shard(0), Shard(1), Partial("sum"), Partial("max")]
    pairs = [(a, b) for a in options for b in options]
    for src in pairs:
        for dst in pairs:
            _run(placements_str(src), placements_str(dst))


def test_no_plan_for_equal_layouts_and_caching() -> None:
    mesh = DeviceMesh.from_shape("cpu", (2, 2))
    assert plan_redistribute((4,), mesh, [Shard(0), R], dst_placements=[Shard(-1), R]).is_noop
    a = plan_on_mesh((2, 2), (Shard(0), R), (R, R))
    assert plan_on_mesh((2, 2), (Shard(0), R), (R, R)) is a


def test_invalid_requests_raise() -> None:
    mesh = DeviceMesh.from_shape("cpu", (2, 2))
    with pytest.raises(RedistributeError, match="placement"):
        plan_redistribute((4,), mesh, [Shard(0)], dst_placements=[R, R])
    with pytest.raises(RedistributeError, match="out of range"):
        plan_redistribute((4,), mesh, [Shard(1), R], dst_placements=[R, R])
    with pytest.raises(RedistributeError, match="not supported"):
        plan_redistribute((4,), mesh, [R, R], dst_placements=[Partial("prod"), R])
    with pytest.raises(RedistributeError, match="dst_placements"):
        plan_redistribute((4,), mesh, [R, R])
    with pytest.raises(RedistributeError, match="negative"):
        plan_redistribute((-1,), mesh, [R, R], dst_placements=[R, R])


def test_steps_validate_their_placements() -> None:
    with pytest.raises(ValueError, match="changes axis 0"):
        AllGather(0, 1, placements_before=(Shard(0), R), placements_after=(R, R))
    with pytest.raises(ValueError, match="no other axis"):
        ReduceScatter(1, "sum", 0, placements_before=(R, Partial()), placements_after=(Shard(0), Shard(0)))


def test_comm_bytes_uneven() -> None:
    mesh = DeviceMesh.from_shape("cpu", (3,))
    # 5 rows over 3 ranks: 2, 2, 1; each rank receives the rows it lacks: 3 + 3 + 4 = 10 rows of 2 elements
    plan = plan_redistribute((5, 2), mesh, [Shard(0)], dst_placements=[R])
    assert plan.comm_bytes(4) == 10 * 2 * 4
    # ring all-reduce: 2 (n-1)/n of the buffer per rank
    plan = plan_redistribute((5, 2), mesh, [Partial()], dst_placements=[R])
    assert plan.comm_bytes(1) == 3 * 2 * 2 * 10 // 3
    assert plan_redistribute((5, 2), mesh, [R], dst_placements=[Shard(1)]).comm_bytes(4) == 0


def test_zero_fill_keeps_value_on_first_rank_only_for_sum() -> None:
    x = torch.arange(4.0)
    plan = plan_redistribute((4,), DeviceMesh.from_shape("cpu", (3,)), [R], dst_placements=[Partial()])
    out = apply_step(plan.steps[0], {(i,): x.clone() for i in range(3)}, (3,))
    assert torch.equal(out[(0,)], x) and not out[(1,)].any() and not out[(2,)].any()


# --- goldens ------------------------------------------------------------------------------------------------------


class TestPlanGoldens(TestCase):
    mesh = DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def plan(self, src: str, dst: str, shape=(8, 6)) -> str:
        return str(
            plan_redistribute(shape, self.mesh, parse_placements(src), dst_placements=parse_placements(dst))
        )

    def test_gather_both_axes(self) -> None:
        self.assertExpectedInline(
            self.plan("S(0)S(1)", "RR"),
            """\
all_gather(axis=1, dim=1)  S(0)S(1) -> S(0)R
all_gather(axis=0, dim=0)  S(0)R -> RR""",
        )

    def test_partial_to_shard(self) -> None:
        self.assertExpectedInline(
            self.plan("P(sum)R", "S(0)R"), """reduce_scatter(axis=0, op=sum, dim=0)  P(sum)R -> S(0)R"""
        )

    def test_nested_shard_to_other_dim(self) -> None:
        self.assertExpectedInline(
            self.plan("S(0)S(0)", "S(1)R"),
            """\
all_gather(axis=1, dim=0)  S(0)S(0) -> S(0)R
all_to_all(axis=0, 0->1)   S(0)R -> S(1)R""",
        )

    def test_replicate_to_shard_and_partial(self) -> None:
        self.assertExpectedInline(
            self.plan("RR", "S(0)P(sum)"),
            """\
local_slice(axis=0, dim=0)  RR -> S(0)R
zero_fill(axis=1, op=sum)   S(0)R -> S(0)P(sum)""",
        )

    def test_submesh_view(self) -> None:
        plan = plan_redistribute((8, 6), self.mesh["tp"], [Shard(1)], self.mesh, [Shard(0), Shard(1)])
        self.assertExpectedInline(str(plan), """local_slice(axis=0, dim=0)  RS(1) -> S(0)S(1)""")

    def test_stage_move(self) -> None:
        stage0, stage1 = self.mesh.unbind("dp")
        same = plan_redistribute((8, 6), stage0, [Shard(0)], stage1, [Shard(0)])
        self.assertExpectedInline(str(same), """p2p(0->2, 1->3)  S(0) -> S(0)""")
        other = plan_redistribute((8, 6), stage0, [Shard(0)], stage1, [Shard(1)])
        self.assertExpectedInline(
            str(other),
            """\
all_gather(axis=0, dim=0)   S(0) -> R
p2p(0->2, 1->3)             R -> R
local_slice(axis=0, dim=1)  R -> S(1)""",
        )
        self.assertEqual(other.comm_bytes(4), 2 * 8 * 6 * 4 + 8 * 6 * 4)
