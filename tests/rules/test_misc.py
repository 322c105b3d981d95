"""Misc family: copies/conversions keep placements (Partial only through linear casts), fill drops Partial,
dropout equals single-device torch under the same seed, composites are intercepted, errors."""

from __future__ import annotations

import pytest
import torch

from tests.rules.harness import Sample, check_sample, to_call
from tests.rules.test_creation import run
from torch_dtorch.errors import ShapeError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import get_rule, intercept_list, rules_by_family
from torch_dtorch.placement_rules.ranks import assemble, coords, distribute, run_all_ranks

aten = torch.ops.aten
R, P = Replicate(), Partial()
PMAX = Partial("max")
S = Shard


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_composites_of_these_families_are_intercepted() -> None:
    families = rules_by_family()
    ops = [op for f in ("misc", "creation", "reduction") for op in families[f]]
    composite = [
        op
        for op in ops
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    ]
    assert {str(op) for op in composite} == {
        "aten.to.dtype", "aten.to.dtype_layout", "aten.to.device", "aten.to.other", "aten.contiguous.default",
        "aten.type_as.default", "aten.dropout.default", "aten.one_hot.default",
    }  # fmt: skip
    assert set(composite) <= set(intercept_list())
    assert not {aten.clone.default, aten._to_copy.default, aten.copy.default} & set(intercept_list())


def test_copies_keep_shards_and_partials() -> None:
    x = rand(5, 1, 7)
    for op, args, kwargs in (
        (aten.clone.default, (), {}),
        (aten.contiguous.default, (), {}),
        (aten._to_copy.default, (), {"dtype": torch.float64, "device": torch.device("cpu")}),
        (aten.to.dtype, (torch.float64,), {}),
        (aten.to.device, ("cpu", torch.float64), {}),
        (aten.to.dtype_layout, (), {"dtype": torch.float64, "device": "cpu"}),
    ):
        for mesh, pl in (((2, 2), (S(0), S(2))), ((2,), (P,)), ((2, 2), (PMAX, S(1))), ((3,), (S(2),))):
            plan = check_sample(op, Sample((x, *args), kwargs), mesh, [pl])
            assert plan.match.in_targets == (pl,) and plan.out_placements == (pl,), (op, pl)
            assert plan.out_meta[0].dtype == (torch.float32 if not args and not kwargs else torch.float64)


def test_cast_to_integer_reduces_partial_first() -> None:
    for op, args, kwargs in (
        (aten._to_copy.default, (), {"dtype": torch.int64}),
        (aten.to.dtype, (torch.int32,), {}),
    ):
        plan = check_sample(op, Sample((rand(5, 3) * 3, *args), kwargs), (2,), [(P,)])
        assert all(not isinstance(p, Partial) for p in plan.match.in_targets[0])
        assert all(not isinstance(p, Partial) for p in plan.out_placements[0])


def test_to_other_and_type_as_leave_other_alone() -> None:
    x, other = rand(5, 3), rand(7).double()
    for op in (aten.to.other, aten.type_as.default):
        plan = check_sample(op, Sample((x, other)), (2, 2), [(S(1), P), (S(0), P)])
        assert plan.match.in_targets == ((S(1), P), (S(0), P)), op
        assert plan.out_placements == ((S(1), P),)
        assert plan.out_meta[0].dtype == torch.float64


def test_copy_takes_self_layout_and_src_values() -> None:
    self_, src = rand(5, 3), rand(3)
    plan = check_sample(aten.copy.default, Sample((self_, src)), (2,), [(S(0),), (R,)])
    assert plan.match.in_targets == ((S(0),), (R,)) and plan.out_placements == ((S(0),),)
    # self's values are overwritten: a Partial self is not reduced
    plan = check_sample(aten.copy.default, Sample((self_, rand(5, 3))), (2,), [(P,), (R,)])
    assert plan.match.in_targets == ((P,), (R,)) and plan.out_placements == ((R,),)
    plan = check_sample(aten.copy.default, Sample((self_, rand(5, 3))), (2,), [(R,), (P,)])
    assert plan.out_placements == ((P,),)


def test_fill_of_partial_is_not_partial() -> None:
    plan = check_sample(aten.fill.Scalar, Sample((rand(5, 3), 2.0)), (2,), [(P,)])
    assert not isinstance(plan.out_placements[0][0], Partial)
    plan = check_sample(
        aten.fill.Tensor, Sample((rand(5, 3), torch.tensor(2.0))), (2, 2), [(S(1), S(0)), (R, R)]
    )
    assert plan.out_placements == ((S(1), S(0)),)


@pytest.mark.parametrize("placements", [(S(0),), (S(1), S(0)), (P,), (P, S(1)), (S(2), S(2))], ids=str)
def test_dropout_train_equals_torch_under_seed(placements: tuple) -> None:
    x = rand(5, 3, 7)
    mesh = (2,) * len(placements)
    torch.manual_seed(7)
    plan, got = run(aten.dropout.default, (x, 0.4, True), mesh, [placements])
    after = torch.get_rng_state()
    torch.manual_seed(7)
    want = aten.dropout.default(x, 0.4, True)
    assert plan.match.in_targets == (placements,) and plan.out_placements == (placements,)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    if P not in placements:
        assert torch.equal(got, want)
    assert torch.equal(after, torch.get_rng_state())


def _run_outputs(op: object, args: tuple, mesh_shape: tuple, placements: list) -> tuple:
    """Plan and run ``op`` on shards; every output assembled (``run`` assembles output 0 only)."""
    call, globals_ = to_call(op, Sample(args), DeviceMesh.from_shape("cpu", mesh_shape), placements)
    rule = get_rule(op)
    plan = rule.plan(call)
    local: dict = {c: [] for c in coords(mesh_shape)}
    for t, target in zip(globals_, plan.match.in_targets, strict=True):
        shards = distribute(t, mesh_shape, target) if t is not None and target is not None else None
        for c in local:
            local[c].append(shards[c] if shards is not None else None)
    outs = run_all_ranks(rule, call, plan.out_placements, local, mesh_shape)
    got = [
        assemble({c: o[k] for c, o in outs.items()}, mesh_shape, pl)
        for k, pl in enumerate(plan.out_placements)
    ]
    return plan, got


@pytest.mark.parametrize("placements", [(S(0),), (S(1), S(0)), (P,), (S(2), S(2))], ids=str)
def test_native_dropout_train_equals_torch_under_seed(placements: tuple) -> None:
    """``native_dropout`` (what compiled training captures for ``F.dropout``): output and bool mask equal CPU
    torch's kernel under one seed, and the generator ends where torch's does."""
    x = rand(5, 3, 7)
    mesh = (2,) * len(placements)
    torch.manual_seed(7)
    plan, got = _run_outputs(aten.native_dropout.default, (x, 0.4, True), mesh, [placements])
    after = torch.get_rng_state()
    torch.manual_seed(7)
    want = aten.native_dropout.default(x, 0.4, True)
    assert plan.match.in_targets == (placements,)
    assert plan.out_placements[0] == placements
    assert got[1].dtype == torch.bool and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    if P not in placements:
        assert torch.equal(got[0], want[0])
    assert torch.equal(after, torch.get_rng_state())


def test_dropout_eval_is_identity_and_keeps_partial() -> None:
    plan = check_sample(aten.dropout.default, Sample((rand(5, 3), 0.5, False)), (2, 2), [(P, S(1))])
    assert plan.out_placements == ((P, S(1)),)
    state = torch.get_rng_state()
    check_sample(aten.dropout.default, Sample((rand(5, 3), 0.5, False)), (2,), [(S(0),)])
    assert torch.equal(state, torch.get_rng_state())


def test_errors() -> None:
    with pytest.raises(ShapeError, match="between 0 and 1"):
        check_sample(aten.dropout.default, Sample((rand(5, 3), 1.5, True)), (2,), [(S(0),)])
    with pytest.raises(NotImplementedError, match="num_classes"):
        check_sample(aten.one_hot.default, Sample((torch.arange(5),)), (2,), [(S(0),)])
    plan = check_sample(aten.one_hot.default, Sample((torch.arange(5), 6)), (3,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)
    assert get_rule(aten.to.device).family == "misc"
