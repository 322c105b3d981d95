"""MLP- and attention-like op sequences through ThreadRunner workers vs the ReferenceExecutor and plain torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.executor.conftest import MakeExecutor
from tests.executor.programs import Feeding, attention, attention_torch, mlp, mlp_torch
from torch_dtorch.apps.demo import build_block, reference
from torch_dtorch.executor.constructor import GraphConstructor
from torch_dtorch.executor.reference import ReferenceExecutor
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate, Shard

Program = Callable[[Any, DeviceMesh], tuple[dict[str, Operand], list[Operand]]]


def _same_as_reference(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Workers run the reference's kernels and collectives on the same shards, so results agree to the last bits;
    allow a few ulps because CPU BLAS may pick another code path in a worker thread than in the main thread (seen
    once in ~100 runs under load). Layout bugs (wrong shard, order, reduction) are far outside this tolerance."""
    torch.testing.assert_close(
        got, ref, atol=1e-6, rtol=1e-6, msg=lambda m: f"{what}: workers vs reference: {m}"
    )


def _reference(program: Program, mesh: DeviceMesh, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    g = GraphConstructor(default_mesh=mesh)
    ins, outs = program(g, mesh)
    ex = ReferenceExecutor(g.graph)
    for name, o in ins.items():
        ex.feed(o, values[name])
    ex.run()
    return [ex.value(o) for o in outs]


def _workers(
    make_executor: MakeExecutor, program: Program, shape: tuple[int, ...], values: dict[str, torch.Tensor]
):
    ex, mesh = make_executor(shape, names=("dp", "tp")[-len(shape) :] if len(shape) == 2 else None)
    ins, outs = program(Feeding(ex, values), mesh)
    futures = [ex.fetch(o) for o in outs]
    return mesh, [f.get(timeout=30) for f in futures]


def _values(program: Program, mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    ins, _ = program(GraphConstructor(default_mesh=mesh), mesh)
    return {n: torch.randn(o.shape) * (1.0 if n == "x" else 0.3) for n, o in ins.items()}


CASES = [
    *((mlp, mlp_torch, shape) for shape in [(1,), (2,), (3,), (4,), (2, 2)]),
    *(
        (attention, attention_torch, shape) for shape in [(1,), (2,), (3,), (4,)]
    ),  # 2x2: test_transformer_block
]


@pytest.mark.parametrize(
    "program,torch_fn,shape", CASES, ids=[f"{p.__name__}-{'x'.join(map(str, s))}" for p, _, s in CASES]
)
def test_program_matches_reference_and_torch(
    make_executor: MakeExecutor, shape: tuple[int, ...], program: Program, torch_fn: Callable[..., Any]
) -> None:
    mesh = DeviceMesh.from_shape("cpu", shape, mesh_dim_names=("dp", "tp") if len(shape) == 2 else None)
    values = _values(program, mesh)
    _, got = _workers(make_executor, program, shape, values)
    ref = _reference(program, mesh, values)
    want = torch_fn(values)
    for i, (g, r, w) in enumerate(zip(got, ref, want)):
        _same_as_reference(g, r, f"output {i}")
        if mesh.size() == 1:
            assert torch.equal(g, w), f"output {i}: a 1-device mesh must be bit-identical with torch"
        else:
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_transformer_block_2x2(make_executor: MakeExecutor) -> None:
    dims = {"batch": 4, "seq": 6, "dim": 16, "heads": 4}
    ex, mesh = make_executor((2, 2), names=("dp", "tp"))
    shapes, _ = build_block(GraphConstructor(default_mesh=mesh), mesh, **dims)
    values = {n: torch.randn(o.shape) * (1.0 if n == "x" else 0.2) for n, o in shapes.items()}
    ins, y = build_block(Feeding(ex, values), mesh, **dims)  # type: ignore[arg-type]
    out = ex.redistribute(y, [Replicate(), Replicate()])
    got_partial, got = ex.fetch(y).get(30), ex.fetch(out).get(30)
    g = GraphConstructor(default_mesh=mesh)
    rins, ry = build_block(g, mesh, **dims)
    rout = g.redistribute(ry, [Replicate(), Replicate()])
    rex = ReferenceExecutor(g.graph)
    for n, o in rins.items():
        rex.feed(o, values[n])
    rex.run()
    _same_as_reference(got, rex.value(rout), "block output")
    want = reference(values, **dims)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_partial, want, atol=1e-5, rtol=1e-5)


def test_one_device_bit_identical_many_ops(make_executor: MakeExecutor) -> None:
    aten = torch.ops.aten
    ex, mesh = make_executor((1,))
    a, b = torch.randn(5, 6), torch.randn(6, 4)
    xa, xb = ex.input(a.shape, mesh, [Replicate()]), ex.input(b.shape, mesh, [Replicate()])
    ex.upload(xa, a)
    ex.upload(xb, b)
    y = ex.call(aten.mm.default, xa, xb)
    y = ex.call(aten.gelu.default, y)
    y = ex.call(aten.sum.dim_IntList, y, [1])
    y = ex.call(aten.exp.default, y)
    want = torch.exp(torch.nn.functional.gelu(a @ b).sum(1))
    assert torch.equal(ex.fetch(y).get(10), want)


def test_factories_on_workers(make_executor: MakeExecutor) -> None:
    aten = torch.ops.aten
    ex, mesh = make_executor((3,))
    r = ex.call(aten.arange.default, 7, device_mesh=mesh, placements=[[Shard(0)]])
    z = ex.call(aten.zeros.default, [5, 2], device_mesh=mesh, placements=[[Shard(1)]])
    torch.manual_seed(5)
    n = ex.call(aten.randn.default, [5, 3], device_mesh=mesh, placements=[[Shard(0)]])
    ex.sync()  # the workers draw from the default generator's state when they run the op
    assert torch.equal(ex.fetch(r).get(timeout=30), torch.arange(7))
    assert torch.equal(ex.fetch(z).get(timeout=30), torch.zeros(5, 2))
    torch.manual_seed(5)
    assert torch.equal(ex.fetch(n).get(timeout=30), torch.randn(5, 3))


def test_reference_runs_communicating_kernels() -> None:
    """A 2-norm and a product over a sharded dim keep the input sharded with kernels that exchange partial results:
    the reference executor runs them with every rank on its own thread (it ran the ranks in turn, without a
    communicator, and failed)."""
    mesh = DeviceMesh.from_shape("cpu", (2, 2))
    g = GraphConstructor(default_mesh=mesh)
    x = g.input((7, 6), mesh, [Shard(0), Shard(1)], tag="x")
    norm = g.call(torch.ops.aten.linalg_vector_norm.default, x, 2, [0, 1])
    prod = g.call(torch.ops.aten.prod.dim_int, x, 0)
    assert [o.op for o in g.graph.operators].count("redistribute") == 0  # nothing gathered
    value = torch.randn(7, 6)
    ex = ReferenceExecutor(g.graph)
    ex.feed(x, value)
    ex.run()
    torch.testing.assert_close(ex.value(norm), torch.linalg.vector_norm(value, 2, [0, 1]))
    torch.testing.assert_close(ex.value(prod), value.prod(0))
