"""Creation family: requested output placements of factories (uneven sizes), sharded arange/linspace/eye, random
factories equal to single-device torch under the same seed (RNG state included), ``*_like`` keeping placements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.rules.harness import Sample, check_sample, to_call
from torch_dtorch.errors import PlacementMismatchError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Placements, Replicate, Shard
from torch_dtorch.placement_rules import get_rule, intercept_list, rules_by_family
from torch_dtorch.placement_rules.ranks import assemble, coords, distribute, run_all_ranks, run_rank
from torch_dtorch.placement_rules.rule import OpPlan

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def run(
    op: Any,
    args: tuple[Any, ...],
    mesh_shape: Sequence[int],
    placements: Sequence[Placements | None] = (),
    out: Placements | None = None,
    kwargs: dict[str, Any] | None = None,
) -> tuple[OpPlan, torch.Tensor]:
    """Plan and run ``op`` on shards (inputs distributed to the plan's targets); returns the assembled output 0."""
    sample = Sample(args, kwargs or {})
    call, globals_ = to_call(
        op, sample, DeviceMesh.from_shape("cpu", tuple(mesh_shape)), list(placements) or None
    )
    rule = get_rule(op)
    plan = rule.plan(call, prefer_outputs=(out,) if out is not None else None)
    local: dict[tuple[int, ...], list[torch.Tensor | None]] = {c: [] for c in coords(mesh_shape)}
    for t, target in zip(globals_, plan.match.in_targets, strict=True):
        shards = distribute(t, mesh_shape, target) if t is not None and target is not None else None
        for c in local:
            local[c].append(shards[c] if shards is not None else None)
    outs = run_all_ranks(rule, call, plan.out_placements, local, mesh_shape)
    return plan, assemble({c: o[0] for c, o in outs.items()}, mesh_shape, plan.out_placements[0])


def test_nothing_in_creation_is_intercepted() -> None:
    assert not set(rules_by_family()["creation"]) & set(intercept_list())


def test_factories_default_to_replicate() -> None:
    for op, args in (
        (aten.zeros.default, ([5, 3],)),
        (aten.arange.default, (7,)),
        (aten.randn.default, ([5, 3],)),
    ):
        plan = check_sample(op, Sample(args, compare=op is not aten.randn.default), (2, 2), [])
        assert plan.out_placements == ((R, R),), op


@pytest.mark.parametrize("out", [(S(0), S(1)), (S(1), S(0)), (S(0), S(0)), (S(1), R), (R, S(1))], ids=str)
def test_factories_produce_requested_placements_on_2x2(out: Placements) -> None:
    for op, args in (
        (aten.zeros.default, ([5, 3],)),
        (aten.ones.default, ([3, 5],)),
        (aten.full.default, ([5, 1], 2.0)),
        (aten.eye.m, (5, 3)),
        (aten.new_full.default, (rand(2), [3, 7], 4.0)),
    ):
        plan = check_sample(
            op,
            Sample(args),
            (2, 2),
            [(S(0), R)] if op is aten.new_full.default else [],
            prefer_outputs=(out,),
        )
        assert plan.out_placements == (out,), op
    # new_* never moves self, whatever its placement
    plan = check_sample(
        aten.new_zeros.default,
        Sample((rand(5, 3), [7, 2])),
        (2, 2),
        [(P, S(1))],
        prefer_outputs=((S(1), S(0)),),
    )
    assert plan.match.in_targets == ((P, S(1)),)


def test_unreachable_output_placement_is_an_error() -> None:
    with pytest.raises(PlacementMismatchError, match="cannot produce"):
        check_sample(aten.arange.default, Sample((7,)), (2,), [], prefer_outputs=((S(1),),))
    with pytest.raises(PlacementMismatchError, match="cannot produce"):
        check_sample(aten.scalar_tensor.default, Sample((1.0,)), (2,), [], prefer_outputs=((S(0),),))


@pytest.mark.parametrize(
    "args",
    [
        (7,),
        (-3, 8),
        (1, 20, 3),
        (0.1, 2.3, 0.3),
        (-1.0, 1.0, 0.15),
        (5.5,),
        (3, 1e8, 2.5e7),
        (2**25, 2**25 + 9),
    ],
    ids=str,
)
def test_arange_sharded_equals_global(args: tuple[Any, ...]) -> None:
    op = {1: aten.arange.default, 2: aten.arange.start, 3: aten.arange.start_step}[len(args)]
    want = op(*args)
    for mesh, out in (((2,), (S(0),)), ((3,), (S(0),)), ((2, 2), (S(0), S(0))), ((4,), (S(0),))):
        plan, got = run(op, args, mesh, out=out)
        assert plan.out_placements == (out,)
        assert got.dtype == want.dtype and torch.equal(got, want), (args, mesh)
    _, got = run(op, args, (2,), out=(S(0),), kwargs={"dtype": torch.float32})
    assert torch.equal(got, op(*args, dtype=torch.float32))


def test_linspace_sharded_equals_global() -> None:
    plan, got = run(aten.linspace.default, (-1.0, 2.0, 7), (2, 2), out=(S(0), S(0)))
    assert torch.equal(got, torch.linspace(-1.0, 2.0, 7))


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.randn.default, ([5, 3],)),
        (aten.rand.default, ([7, 1, 3],)),
        (aten.randn_like.default, (rand(5, 3),)),
        (aten.randn_like.default, (rand(3, 5).t(),)),
        (aten.rand_like.default, (rand(5, 3),)),
    ],
    ids=str,
)
def test_random_sharded_equals_torch_under_seed(op: Any, args: tuple[Any, ...]) -> None:
    placements: list[Placements | None] = []
    for mesh, out in (((2,), (S(0),)), ((3,), (S(1),)), ((2, 2), (S(1), S(0))), ((2, 2), (S(0), S(0)))):
        is_like = isinstance(args[0], torch.Tensor)
        placements = [out] if is_like else []
        torch.manual_seed(1234)
        plan, got = run(op, args, mesh, placements, out=None if is_like else out)
        after = torch.get_rng_state()
        torch.manual_seed(1234)
        want = op(*args)
        assert plan.out_placements == (out,)
        assert torch.equal(got, want), (op, mesh, out)
        assert torch.equal(after, torch.get_rng_state()), (
            "the default generator must advance as for one global draw"
        )
        # the same call again draws fresh numbers, continuing the RNG stream like torch
        torch.manual_seed(1234)
        op(*args)
        want2 = op(*args)
        torch.manual_seed(1234)
        op(*args)
        _, got2 = run(op, args, mesh, placements, out=None if is_like else out)
        assert torch.equal(got2, want2)


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.zeros.default, ([4, 6],)),
        (aten.arange.default, (4,)),
        (aten.arange.start_step, (0.5, 4.5, 0.5)),
        (aten.linspace.default, (0.0, 1.0, 4)),
        (aten.eye.m, (4, 6)),
    ],
    ids=str,
)
def test_factories_create_on_the_rank_device(op: Any, args: tuple[Any, ...]) -> None:
    """Workers set no default device: factory kernels create on the rank's ``torch_device`` (``meta`` here)."""
    call, _ = to_call(op, Sample(args), DeviceMesh.from_shape("cpu", (2,)), None)
    rule = get_rule(op)
    plan = rule.plan(call, prefer_outputs=((S(0),),))
    meta = torch.device("meta")
    for c in coords((2,)):
        (out,) = run_rank(rule, call, c, (2,), [], plan.out_placements, device=c[0], torch_device=meta)
        assert out.device == meta, (op, c)


def test_like_ops_keep_placement() -> None:
    x = rand(5, 1, 7)
    for op, extra in (
        (aten.zeros_like.default, ()),
        (aten.ones_like.default, ()),
        (aten.full_like.default, (2.0,)),
        (aten.rand_like.default, ()),
        (aten.empty_like.default, ()),
    ):
        compare = op not in (aten.rand_like.default, aten.empty_like.default)
        for mesh, pl in (((2,), (S(2),)), ((2, 2), (S(0), S(1))), ((3,), (S(1),))):
            plan = check_sample(op, Sample((x, *extra), compare=compare), mesh, [pl])
            assert plan.match.in_targets == (pl,) and plan.out_placements == (pl,), (op, pl)
    # only zeros_like keeps a Partial input; ones of a Partial would sum to n
    plan = check_sample(aten.zeros_like.default, Sample((x,)), (2,), [(P,)])
    assert plan.out_placements == ((P,),)
    for p in (Partial("max"), Partial("avg")):
        plan = check_sample(aten.zeros_like.default, Sample((x,)), (2, 2), [(p, S(0))])
        assert plan.out_placements == ((p, S(0)),)
    plan = check_sample(aten.ones_like.default, Sample((x,)), (2,), [(P,)])
    assert P not in plan.out_placements[0]
