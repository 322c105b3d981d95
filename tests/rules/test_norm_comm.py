"""p-norms and ``prod`` over a sharded dim stay sharded: ``S(d) -> R`` with a kernel that exchanges partial results
(``norm_comm.py``). Checked against plain torch on real worker meshes (thread mode, uneven and empty shards), with no
input ever redistributed; inside ``torch.compile``; on the simulator (Partial inputs, the plan and its cost)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import _shutdown_at_end  # noqa: F401 - stops the session's worker pool at the end
from tests.rules.harness import Sample, check_sample
from torch_dtorch.executor.constructor import REDISTRIBUTE
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules import OpCall, get_rule
from torch_dtorch.placement_rules.families.context_parallel import kernel_needs_comm

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard
NORM = aten.linalg_vector_norm.default

#: 7 rows: 4+3 on 2 devices, 3+3+1 on 3, 2+2+2+1 on 4; 6 columns: 2+2+2+0 on 4 (an empty shard)
X = torch.randn(7, 6, generator=torch.Generator().manual_seed(0))
POS = torch.rand(7, 6, generator=torch.Generator().manual_seed(1)) + 0.5  # products stay in range

#: (mesh shape, input placements): every dim sharded alone, nested on 2x2, and a kept dim next to a reduced one
LAYOUTS: list[tuple[tuple[int, ...], tuple[Placement, ...]]] = [
    ((2,), (S(0),)),
    ((2,), (S(1),)),
    ((3,), (S(0),)),
    ((3,), (S(1),)),
    ((4,), (S(0),)),
    ((4,), (S(1),)),
    ((2, 2), (S(0), S(0))),
    ((2, 2), (S(1), S(1))),
    ((2, 2), (S(0), S(1))),
    ((2, 2), (S(1), S(0))),
]
ORDERS: list[float | str] = [2, 3, 0.5, "fro"]
DIMS: list[int | tuple[int, ...] | None] = [None, 0, 1, (0, 1)]


def _layout_id(layout: tuple[tuple[int, ...], tuple[Placement, ...]]) -> str:
    shape, pl = layout
    return "x".join(map(str, shape)) + "-" + "".join(f"S{p.dim}" for p in pl if isinstance(p, Shard))


def _mesh(shape: tuple[int, ...]) -> dt.DeviceMesh:
    """A mesh of worker threads (the session's pool is reused; it may have been restarted by another test)."""
    return dt.init_device_mesh("cpu", shape, mode="thread")


@contextlib.contextmanager
def _operators() -> Iterator[list[Any]]:
    """Every operator the controller adds while the block runs (redistributes included)."""
    from torch_dtorch.device.state import get_session

    listeners = get_session().executor.constructor.listeners
    seen: list[Any] = []
    listeners.append(seen.append)
    try:
        yield seen
    finally:
        listeners.remove(seen.append)


def _expected(pl: tuple[Placement, ...], dims: list[int], keepdim: bool) -> tuple[Placement, ...]:
    """Replicate on the axes that shard a reduced dim; a kept dim's shard follows it (shifted without keepdim)."""
    out: list[Placement] = []
    for p in pl:
        assert isinstance(p, Shard)
        if p.dim in dims:
            out.append(R)
        else:
            out.append(S(p.dim if keepdim else p.dim - sum(1 for d in dims if d < p.dim)))
    return tuple(out)


def _gathers(node: Any) -> bool:
    """A redistribute that turns a Shard into something else (the conformance run's "gathered an input")."""
    src, dst = node.inputs[0], node.outputs[0]
    return any(
        isinstance(a, Shard) and not isinstance(b, Shard)
        for a, b in zip(src.root_placements, dst.root_placements, strict=True)
    )


def _run(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    mesh: dt.DeviceMesh,
    pl: tuple[Placement, ...],
    *,
    strict: bool = True,
) -> tuple[torch.Tensor, tuple[Placement, ...]]:
    """``fn`` on ``x`` distributed with ``pl``: the result and its placements. Fails if anything was redistributed
    (``strict``) or, otherwise, if any shard was gathered (a free Replicate -> Shard slice is allowed)."""
    d = dt.distribute_tensor(x, mesh, list(pl))
    with _operators() as ops:
        out = fn(d)
    moved = [n for n in ops if n.op == REDISTRIBUTE and (strict or _gathers(n))]
    assert not moved, f"redistributed: {[n.note for n in moved]}"
    assert ops, "no operator ran"
    return out.full_tensor(), tuple(out.placements)


def _norm_fn(
    order: float | str, dim: int | tuple[int, ...] | None, keepdim: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.norm(x, 'fro', ...)`` or ``torch.linalg.vector_norm(x, order, ...)`` (both reach
    ``linalg_vector_norm``)."""
    if order == "fro":
        return lambda t: torch.norm(t, "fro", dim, keepdim)
    assert not isinstance(order, str)
    return lambda t: torch.linalg.vector_norm(t, order, dim, keepdim)


def _norm_dims(dim: int | tuple[int, ...] | None) -> list[int]:
    return [0, 1] if dim is None else ([dim] if isinstance(dim, int) else list(dim))


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_vector_norms_over_sharded_dims_match_torch_without_gathering(
    layout: tuple[tuple[int, ...], tuple[Placement, ...]],
) -> None:
    shape, pl = layout
    mesh = _mesh(shape)
    for order, dim, keepdim in itertools.product(ORDERS, DIMS, (False, True)):
        fn = _norm_fn(order, dim, keepdim)
        want = fn(X)
        got, placements = _run(fn, X, mesh, pl)
        where = f"ord={order} dim={dim} keepdim={keepdim} on {shape} {pl}"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
        assert placements == _expected(pl, _norm_dims(dim), keepdim), where


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_prod_over_sharded_dims_matches_torch_without_gathering(
    layout: tuple[tuple[int, ...], tuple[Placement, ...]],
) -> None:
    shape, pl = layout
    mesh = _mesh(shape)
    cases: list[tuple[Callable[[torch.Tensor], torch.Tensor], list[int], bool]] = [
        (lambda t: torch.prod(t), [0, 1], False),
        (lambda t: torch.prod(t, 0), [0], False),
        (lambda t: torch.prod(t, 1), [1], False),
        (lambda t: torch.prod(t, 0, keepdim=True), [0], True),
        (lambda t: torch.prod(t, -1, keepdim=True), [1], True),
        (lambda t: torch.prod(t, 1, dtype=torch.float64), [1], False),
    ]
    for i, (fn, dims, keepdim) in enumerate(cases):
        got, placements = _run(fn, POS, mesh, pl)
        torch.testing.assert_close(got, fn(POS), rtol=1e-5, atol=0, msg=lambda m, i=i: f"case {i}: {m}")
        assert placements == _expected(pl, dims, keepdim), (i, placements)
    ints = torch.randint(-3, 4, (7, 6), generator=torch.Generator().manual_seed(2))
    for fn, dims, keepdim in cases[:3]:
        got, placements = _run(fn, ints, mesh, pl)
        assert got.dtype == torch.int64 and torch.equal(got, fn(ints))  # integer products are exact
        assert placements == _expected(pl, dims, keepdim)


def test_norm_overloads_dtype_and_complex_inputs() -> None:
    mesh = _mesh((3,))
    # norm.ScalarOpt_dim, directly and through torch.dist (|x - y| is sharded like its inputs)
    for p, dims, keepdim in ((2, [0], False), (3, [1], True), (None, [0, 1], False), (0.5, [], False)):
        fn = lambda t, p=p, d=dims, k=keepdim: aten.norm.ScalarOpt_dim(t, p, d, k)
        got, placements = _run(fn, X, mesh, (S(0),))
        torch.testing.assert_close(got, fn(X), rtol=1e-5, atol=1e-6)
        assert placements == ((S(0),) if dims == [1] else (R,))
    y = torch.randn(7, 6, generator=torch.Generator().manual_seed(3))
    dx, dy = (dt.distribute_tensor(t, mesh, [S(0)]) for t in (X, y))
    with _operators() as ops:
        out = torch.dist(dx, dy, 2.5)
    assert not [n for n in ops if n.op == REDISTRIBUTE]
    torch.testing.assert_close(out.full_tensor(), torch.dist(X, y, 2.5))
    # dtype= casts before the reduction; complex inputs give real norms
    fn = lambda t: torch.linalg.vector_norm(t, 2, dim=0, dtype=torch.float64)
    got, _ = _run(fn, X, mesh, (S(0),))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, fn(X))
    z = torch.complex(X, y)
    for order in (2, 3):
        fn = lambda t, o=order: torch.linalg.vector_norm(t, o, dim=0)
        got, placements = _run(fn, z, mesh, (S(0),))
        assert got.dtype == torch.float32 and placements == (R,)
        torch.testing.assert_close(got, fn(z))
    # a normalization over the sharded dim (cosine_similarity, F.normalize with p=2) keeps its input sharded
    fn = lambda t: torch.nn.functional.cosine_similarity(t, t.cos(), dim=1)
    got, _ = _run(fn, X, mesh, (S(1),), strict=False)
    torch.testing.assert_close(got, fn(X))
    fn = lambda t: torch.nn.functional.normalize(t, p=2.0, dim=0)
    got, placements = _run(fn, X, mesh, (S(0),), strict=False)  # the norm is sliced back to the rows (free)
    torch.testing.assert_close(got, fn(X))
    assert placements == (S(0),)


def test_one_device_mesh_is_bit_identical() -> None:
    mesh = _mesh((1,))
    for pl in ((R,), (S(0),)):
        for fn in (
            lambda t: torch.linalg.vector_norm(t, 2, dim=0),
            lambda t: torch.norm(t, "fro"),
            lambda t: torch.linalg.vector_norm(t, 0.5, dim=(0, 1), keepdim=True),
            lambda t: torch.prod(t, 1),
            lambda t: torch.prod(t),
        ):
            out = fn(dt.distribute_tensor(POS, mesh, list(pl)))
            assert torch.equal(out.full_tensor(), fn(POS))


def test_compiled_graph_runs_the_exchange_as_a_comm_kernel_step() -> None:
    from torch_dtorch.backend.report import CompileReport

    mesh = _mesh((2,))
    d = dt.distribute_tensor(POS, mesh, [S(0)])

    def fn(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (
            torch.linalg.vector_norm(t, 2, dim=0) + 1,
            torch.prod(t, 0),
            t / torch.norm(t, 3, 0, keepdim=True),
        )

    reports: list[CompileReport] = []
    with torch.no_grad():
        outs = torch.compile(fn, backend="dtorch", options={"reports": reports})(d)
    for got, want in zip(outs, fn(POS), strict=True):
        torch.testing.assert_close(got.full_tensor(), want)
    assert [o.placements for o in outs] == [(R,), (R,), (S(0),)]
    (report,) = reports
    assert "redistribute" not in report.logical, report.logical
    local = report.local[mesh.devices[0]]
    assert local.count("aten.linalg_vector_norm[rule kernel, comm]") == 2, local
    assert "aten.prod.dim_int[rule kernel, comm]" in local, local


# --- the plan, on the simulator ---------------------------------------------------------------------------------------


def test_plan_keeps_the_reduced_dim_sharded_and_prices_only_the_exchange() -> None:
    x = torch.randn(64, 32)
    for op, args in (
        (NORM, (x, 2, [0])),
        (aten.prod.dim_int, (x, 0)),
        (aten.norm.ScalarOpt_dim, (x, 3, [0])),
    ):
        mesh = DeviceMesh.from_shape("cpu", (4,))
        call = OpCall.make(op, (Operand(0, (64, 32), torch.float32, mesh, (S(0),)), *args[1:]), {})
        plan = get_rule(op).plan(call)
        assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((R,),), op
        assert kernel_needs_comm(call.retarget(list(call.inputs), list(plan.match.in_targets)))
        # every device receives 3 partial results of 32 floats: far below all-gathering the 64x32 input
        assert plan.cost.comm_bytes == 4 * 3 * 32 * 4, plan.cost
        assert plan.cost.comm_bytes < x.nbytes * 3 / 4
    # orders that combine as a Partial, and Replicate inputs, do not communicate
    call = OpCall.make(NORM, (Operand(0, (64, 32), torch.float32, mesh, (S(0),)), 1, [0]), {})
    assert not kernel_needs_comm(call) and get_rule(NORM).plan(call).cost.comm_bytes == 0
    call = OpCall.make(NORM, (Operand(0, (64, 32), torch.float32, mesh, (R,)), 2, [0]), {})
    assert not kernel_needs_comm(call)


def test_simulated_exchange_nested_axes_and_partial_inputs() -> None:
    x = torch.randn(7, 1, 5, generator=torch.Generator().manual_seed(4))
    # one dim sharded by both axes of a 2x2 mesh: one group of 4; two reduced dims on two axes: one group too
    for placements in ((S(0), S(0)), (S(0), S(2)), (S(1), S(0))):
        plan = check_sample(NORM, Sample((x, 3, [0, 1, 2])), (2, 2), [placements])
        assert plan.match.in_targets == (placements,) and plan.out_placements == ((R, R),)
        plan = check_sample(aten.prod.default, Sample((x.abs() + 0.5,)), (2, 2), [placements])
        assert plan.match.in_targets == (placements,) and plan.out_placements == ((R, R),)
    # a kept dim on one axis, a reduced one on the other
    plan = check_sample(NORM, Sample((x, 0.5, [2], True)), (2, 2), [(S(0), S(2))])
    assert plan.out_placements == ((S(0), R),)
    # a Partial input is reduce-scattered onto a dim (cheaper than the all-reduce to Replicate), then exchanged
    plan = check_sample(NORM, Sample((torch.randn(7), 2)), (2,), [(P,)])
    assert plan.match.in_targets == ((S(0),),) and plan.out_placements == ((R,),)
