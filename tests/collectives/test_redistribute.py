"""``execute_plan`` with one thread per device over an in-memory world gives exactly ``plan_sim``'s shards."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.collectives.util import run_ranks
from torch_dtorch.collectives import CollectiveError, InMemoryComm, InMemoryWorld, execute_plan
from torch_dtorch.errors import ShapeError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Placement, Replicate, Shard, parse_placements
from torch_dtorch.placement_rules.ranks import distribute
from torch_dtorch.placement_rules.redistribute.planner import RedistributePlan, plan_redistribute
from torch_dtorch.placement_rules.redistribute.simulate import apply_plan

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.int64)
MAX_DEVICES = 8


def placement(ndim: int, kinds: str = "RSP") -> st.SearchStrategy[Placement]:
    options: list[st.SearchStrategy[Placement]] = []
    if "R" in kinds:
        options.append(st.just(Replicate()))
    if "S" in kinds:
        options.append(st.builds(Shard, st.integers(0, ndim - 1)))
    if "P" in kinds:
        options.append(st.builds(Partial, st.sampled_from(OPS)))
    return st.one_of(*options)


def mesh_shape(max_size: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    shapes = st.lists(st.integers(1, max_size), min_size=1, max_size=3).map(tuple)
    return shapes.filter(lambda s: math.prod(s) <= MAX_DEVICES)


@st.composite
def case(draw: st.DrawFn, src_kinds: str = "RSP", dst_kinds: str = "RSP", min_ndim: int = 1) -> tuple:
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=min_ndim, max_size=3)))
    ms = draw(mesh_shape())
    src = draw(st.tuples(*(placement(len(shape), src_kinds) for _ in ms)))
    dst = draw(st.tuples(*(placement(len(shape), dst_kinds) for _ in ms)))
    return shape, ms, src, dst, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31 - 1))


def _run(plan: RedistributePlan, shards: dict, *, dtype: torch.dtype) -> None:
    """Execute ``plan`` on one thread per device and compare with ``plan_sim`` (torch.equal, dtype, no aliasing)."""
    src_root, dst_root = plan.src_mesh.root, plan.dst_mesh.root
    src_coord = {d: c for d, c in src_root.coordinates()}
    dst_coord = {d: c for d, c in dst_root.coordinates()}
    devices = sorted(set(src_coord) | set(dst_coord))
    want = apply_plan(plan, shards)
    world = InMemoryWorld(devices, timeout_s=20)

    def body(d: int) -> torch.Tensor | None:
        local = shards[src_coord[d]] if d in src_coord else None
        return execute_plan(plan, local, device=d, comm=InMemoryComm(world, d))

    out = run_ranks(devices, body).check()
    for d in devices:
        if d not in dst_coord:
            assert out[d] is None, d
            continue
        got, exp = out[d], want[dst_coord[d]]
        assert got is not None and got.dtype == dtype
        assert got.shape == exp.shape, (d, got.shape, exp.shape, str(plan))
        assert torch.equal(got, exp), (d, str(plan))
        if d in src_coord and got.numel():
            assert got.data_ptr() != shards[src_coord[d]].data_ptr()


def _shards(shape, ms, src, dtype, seed) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 8).to(dtype)
    return distribute(x, ms, src, gen=gen)


@SETTINGS
@given(case())
def test_execute_plan_matches_plan_sim(c) -> None:
    shape, ms, src, dst, dtype, seed = c
    mesh = DeviceMesh.from_shape("cpu", ms)
    plan = plan_redistribute(shape, mesh, src, dst_placements=dst)
    _run(plan, _shards(shape, ms, src, dtype, seed), dtype=dtype)


@settings(SETTINGS, max_examples=40)
@given(case(src_kinds="SP", dst_kinds="S", min_ndim=2))
def test_execute_scatter_and_all_to_all_plans(c) -> None:
    """Shard/Partial -> Shard: mostly reduce-scatters and all-to-alls (rare in the general strategy)."""
    test_execute_plan_matches_plan_sim.hypothesis.inner_test(c)


@settings(SETTINGS, max_examples=40)
@given(case(), mesh_shape(3), st.booleans(), st.data())
def test_execute_cross_mesh_plan_matches_plan_sim(c, dst_ms, same, data) -> None:
    shape, src_ms, src, _, dtype, seed = c
    if same:
        dst_ms = src_ms
    dst = src if same else data.draw(st.tuples(*(placement(len(shape)) for _ in dst_ms)))
    n_src, n_dst = math.prod(src_ms), math.prod(dst_ms)
    # destination ids start anywhere from 0 to n_src, so the meshes may overlap (a device both sends and
    # receives) or be disjoint; but never equal (that is a same-mesh plan)
    start = data.draw(st.integers(0 if (dst_ms != src_ms) else 1, n_src))
    src_mesh = DeviceMesh.from_shape("cpu", src_ms)
    dst_mesh = DeviceMesh("cpu", torch.arange(start, start + n_dst).reshape(dst_ms))
    plan = plan_redistribute(shape, src_mesh, src, dst_mesh, dst)
    assert plan.cross_mesh
    _run(plan, _shards(shape, src_ms, src, dtype, seed), dtype=dtype)


@pytest.mark.parametrize(
    ("src", "dst", "shape", "ms"),
    [
        ("S(0)S(0)", "S(1)R", (5, 3), (2, 3)),  # nested uneven -> other dim
        ("P(sum)S(0)", "S(0)P(max)", (7, 2), (2, 2)),
        ("S(1)P(avg)", "RR", (2, 0), (3, 2)),  # empty global dim
        ("P(min)P(min)", "S(0)S(0)", (3,), (2, 2)),  # reduce-scatter with empty chunks
        ("S(0)R", "RS(0)", (1, 4), (4, 2)),  # most ranks empty
        ("P(sum)", "R", (9, 2), (8,)),  # 8-rank reductions
        ("P(avg)", "S(0)", (9, 2), (8,)),
        ("S(1)", "S(0)", (9, 2), (8,)),
    ],
)
def test_named_cases(src: str, dst: str, shape: tuple[int, ...], ms: tuple[int, ...]) -> None:
    mesh = DeviceMesh.from_shape("cpu", ms)
    plan = plan_redistribute(shape, mesh, parse_placements(src), dst_placements=parse_placements(dst))
    _run(plan, _shards(shape, ms, parse_placements(src), torch.float32, 3), dtype=torch.float32)


def test_submesh_views_and_a_sequence_of_plans_on_one_world() -> None:
    """Several plans back to back on one world (the sequence numbers of shared groups keep advancing)."""
    root = DeviceMesh.from_shape("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
    shape = (5, 7)
    layouts = [
        (root, "S(0)S(1)"),
        (root["tp"], "P(sum)"),
        (root, "RS(0)"),
        (root["dp"], "S(1)"),
        (root, "S(1)P(max)"),
        (root, "RR"),
    ]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    plans = []
    for (m0, p0), (m1, p1) in zip(layouts, layouts[1:]):
        plans.append(plan_redistribute(shape, m0, parse_placements(p0), m1, parse_placements(p1)))
    first = distribute(x, root.shape, plans[0].src_placements)
    world = InMemoryWorld(root.devices, timeout_s=20)
    coords = dict(root.coordinates())

    def body(d: int) -> torch.Tensor | None:
        comm = InMemoryComm(world, d)
        t = first[coords[d]]
        for plan in plans:
            t = execute_plan(plan, t, device=d, comm=comm)
        return t

    out = run_ranks(root.devices, body).check()
    want = dict(first)
    for plan in plans:
        want = apply_plan(plan, want)
    for d in root.devices:
        assert torch.equal(out[d], want[coords[d]])
    torch.testing.assert_close(out[0], x)


def test_noop_plan_returns_a_copy() -> None:
    mesh = DeviceMesh.from_shape("cpu", (1,))
    plan = plan_redistribute((3,), mesh, [Replicate()], dst_placements=[Replicate()])
    x = torch.arange(3.0)
    y = execute_plan(plan, x, device=0, comm=InMemoryComm(InMemoryWorld((0,)), 0))
    assert y is not None and torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_bad_local_inputs_raise() -> None:
    mesh = DeviceMesh.from_shape("cpu", (2,))
    plan = plan_redistribute((4,), mesh, [Shard(0)], dst_placements=[Replicate()])
    world = InMemoryWorld((0, 1, 2))
    with pytest.raises(ShapeError, match=r"needs \(2,\)"):
        execute_plan(plan, torch.ones(3), device=0, comm=InMemoryComm(world, 0))
    with pytest.raises(ShapeError, match="must pass its local shard"):
        execute_plan(plan, None, device=0, comm=InMemoryComm(world, 0))
    with pytest.raises(ShapeError, match="must pass None"):
        execute_plan(plan, torch.ones(2), device=2, comm=InMemoryComm(world, 2))
    with pytest.raises(CollectiveError, match="communicator of device 1"):
        execute_plan(plan, torch.ones(2), device=0, comm=InMemoryComm(world, 1))
