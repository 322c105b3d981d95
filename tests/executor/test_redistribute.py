"""Every redistribute transition through real (in-memory) collectives: per-rank shards equal the planner's
plain-torch simulation bit for bit, and the fetched global value equals the input. Shapes are uneven."""

from __future__ import annotations

from itertools import product

import pytest
import torch

from tests.executor.conftest import MakeExecutor
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Placement, Replicate, Shard, placements_str
from torch_dtorch.placement_rules.ranks import distribute
from torch_dtorch.placement_rules.redistribute.planner import plan_redistribute
from torch_dtorch.placement_rules.redistribute.simulate import apply_plan

AXIS_PLACEMENTS: list[Placement] = [Shard(0), Shard(1), Replicate(), Partial("sum")]


def _layouts(ndim: int, extra: tuple[Placement, ...] = ()) -> list[tuple[Placement, ...]]:
    return list(product(AXIS_PLACEMENTS + list(extra), repeat=ndim))


@pytest.mark.parametrize(
    "mesh_shape,extra",
    [((3,), (Partial("max"), Partial("avg"))), ((4,), ()), ((2, 2), ())],
    ids=str,
)
def test_every_transition(make_executor: MakeExecutor, mesh_shape: tuple[int, ...], extra: tuple) -> None:
    ex, mesh = make_executor(mesh_shape)
    root = mesh.root
    value = torch.randn(7, 5)
    layouts = _layouts(len(mesh_shape), extra)
    cases = []
    sources = {}
    for src in layouts:
        x = ex.input(value.shape, mesh, src)
        ex.upload(x, value)
        sources[src] = x
    for src, dst in product(layouts, layouts):
        if isinstance(src[0], Partial) and isinstance(dst[0], Partial) and src[0] != dst[0]:
            continue  # changing the reduce op of a partial is not a redistribute
        y = ex.redistribute(sources[src], dst)
        cases.append((src, dst, y, ex.fetch(y)))
    ex.sync()
    coords = dict(root.coordinates())
    for src, dst, y, fut in cases:
        what = f"{placements_str(src)} -> {placements_str(dst)}"
        plan = plan_redistribute(value.shape, mesh, src, dst_mesh=mesh, dst_placements=dst)
        want = apply_plan(plan, distribute(value, root.shape, src, gen=None))
        for d, worker in ex.runner.workers.items():
            blob = worker.blobs[y.id]
            assert blob.error is None, f"{what}: {blob.error}"
            assert torch.equal(blob.tensor, want[coords[d]]), (
                f"{what}: rank {coords[d]} differs from plan_sim"
            )
        got = fut.get(timeout=30)
        if any(isinstance(p, Partial) and p.reduce_op == "avg" for p in (*src, *dst)):
            torch.testing.assert_close(got, value)
        else:
            assert torch.equal(got, value), what


def test_across_meshes(make_executor: MakeExecutor) -> None:
    """Pipeline-stage moves: point-to-point between disjoint meshes of one runner."""
    ex, mesh = make_executor((2, 2), names=("pp", "tp"))
    s0, s1 = mesh.unbind("pp")
    one = DeviceMesh("cpu", [3])
    value = torch.randn(5, 6)
    x = ex.input(value.shape, s0, [Shard(0)])
    ex.upload(x, value)
    moves = [
        ex.redistribute(x, [Shard(0)], device_mesh=s1),
        ex.redistribute(x, [Shard(1)], device_mesh=s1),
        ex.redistribute(x, [Replicate()], device_mesh=s1),
        ex.redistribute(x, [Partial()], device_mesh=s1),
        ex.redistribute(x, [Replicate()], device_mesh=one),
    ]
    back = ex.redistribute(moves[1], [Shard(0)], device_mesh=s0)
    for y in [*moves, back]:
        assert torch.equal(ex.fetch(y).get(timeout=30), value)
    ex.sync()
    assert x.id in ex.runner.workers[0].blobs and x.id not in ex.runner.workers[2].blobs
    assert moves[0].id in ex.runner.workers[2].blobs and moves[0].id not in ex.runner.workers[0].blobs


def test_uneven_and_empty_shards(make_executor: MakeExecutor) -> None:
    aten = torch.ops.aten
    ex, mesh = make_executor((4,))
    value = torch.randn(2, 3)  # dim 0 split 4 ways: sizes 1, 1, 0, 0
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    y = ex.call(aten.mul.Tensor, x, x)
    z = ex.redistribute(y, [Shard(1)])
    w = ex.redistribute(z, [Replicate()])
    assert torch.equal(ex.fetch(w).get(timeout=30), value * value)
    ex.sync()
    assert [tuple(ex.runner.workers[d].blobs[y.id].tensor.shape) for d in range(4)] == [
        (1, 3),
        (1, 3),
        (0, 3),
        (0, 3),
    ]
