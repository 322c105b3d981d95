"""Shape family: cat/stack keep shards off the joined dim, flip/roll/repeat/tril keep untouched dims sharded."""

from __future__ import annotations

import math

import torch

from tests.rules.harness import Sample, check_sample, to_call
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import get_rule, intercept_list
from torch_dtorch.placement_rules.families.comm import kernel_needs_comm
from torch_dtorch.placement_rules.families.shape import SHAPE_OPS

aten = torch.ops.aten
R, P = Replicate(), Partial()
S = Shard


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def test_shape_ops_are_fresh_tensors_and_not_composites() -> None:
    intercepted = set(intercept_list())
    for op in [*SHAPE_OPS, aten.cat.default]:
        assert get_rule(op).family == "shape" and get_rule(op).view_of is None
        composite = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        assert (op in intercepted) == composite, op


def test_cat_along_unsharded_dim_keeps_shard() -> None:
    plan = check_sample(aten.cat.default, Sample(([rand(5, 3), rand(5, 2)], 1)), (2,), [(S(0),), (S(0),)])
    assert plan.match.in_targets == ((S(0),), (S(0),))
    assert plan.out_placements == ((S(0),),)
    # a replicated peer is sliced locally to match
    plan = check_sample(aten.cat.default, Sample(([rand(5, 3), rand(5, 2)], -1)), (2, 2), [(S(0), R), (R, R)])
    assert plan.out_placements == ((S(0), R),)


def test_cat_along_sharded_dim_communicates_and_stays_sharded() -> None:
    """All inputs sharded on the cat dim: the cat exchanges rows and keeps the shard (uneven, nested, 3 ranks)."""
    for mesh_shape, pl in (((2,), (S(0),)), ((3,), (S(0),)), ((2, 2), (S(0), S(0))), ((2, 2), (S(0), S(1)))):
        sample = Sample(([rand(5, 3), rand(2, 3), rand(7, 3)],))
        plan = check_sample(aten.cat.default, sample, mesh_shape, [pl] * 3)
        assert plan.match.in_targets == (pl,) * 3
        assert plan.out_placements == (pl,)
        mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape))
        call = to_call(aten.cat.default, sample, mesh, [pl] * 3)[0]
        get_rule(aten.cat.default).plan(call)
        assert kernel_needs_comm(call)


def test_cat_with_replicated_peer_along_sharded_dim_is_not_communicating() -> None:
    """A decode step: the sequence-sharded cache next to a replicated new token gets no communicating signature."""
    plan = check_sample(aten.cat.default, Sample(([rand(5, 3), rand(1, 3)],)), (2,), [(S(0),), (R,)])
    assert plan.out_placements != ((S(0),),)


def test_cat_skips_legacy_empty_inputs() -> None:
    """``cat([torch.tensor([]), x])`` is ``x``: the shards of ``x`` stay where they are, on any dim."""
    for d in (0, 1):
        plan = check_sample(
            aten.cat.default, Sample(([torch.empty(0), rand(5, 3)], 0)), (2,), [(R,), (S(d),)]
        )
        assert plan.match.in_targets == ((R,), (S(d),))
        assert plan.out_placements == ((S(d),),)


def test_cat_keeps_empty_inputs_in_place() -> None:
    """An input with no rows along the cat dim (an empty KV cache ``[B, H, 0, D]``, or a legacy ``tensor([])``)
    keeps its placements, whatever they are: no redistribute, and the decision is the non-empty input's alone (a
    sequence-sharded ``k`` stays sequence-sharded instead of being moved to a dim both could share)."""
    k = rand(2, 4, 5, 3)
    cases = [
        ((2,), (R,), (S(2),)),  # empty replicated, k sequence-sharded (a cp prefill)
        ((2,), (S(0),), (S(2),)),  # the empty batch-sharded, k sequence-sharded
        ((2, 2), (S(0), R), (S(0), S(2))),  # dp x cp
        ((2, 2), (S(1), S(3)), (S(0), S(2))),
        ((2,), (P,), (S(1),)),
    ]
    for mesh_shape, empty_pl, k_pl in cases:
        for empty in (torch.empty(2, 4, 0, 3), torch.empty(0)):
            if empty.ndim == 1 and any(type(p) is Shard and p.dim > 0 for p in empty_pl):
                continue
            plan = check_sample(aten.cat.default, Sample(([empty, k], 2)), mesh_shape, [empty_pl, k_pl])
            assert plan.match.in_targets == (empty_pl, k_pl), (mesh_shape, empty.shape, plan.match.in_targets)
            assert plan.out_placements == (k_pl,)
    # the empty input's dtype still promotes (torch's cat does), and a kept input that needs moving still moves
    plan = check_sample(
        aten.cat.default,
        Sample(([torch.empty(2, 4, 0, 3, dtype=torch.float64), k], 2)),
        (2,),
        [(S(0),), (S(2),)],
    )
    assert plan.out_meta[0].dtype == torch.float64 and plan.out_placements == ((S(2),),)
    plan = check_sample(
        aten.cat.default,
        Sample(([torch.empty(2, 0), rand(2, 3), rand(2, 1)], 1)),
        (2,),
        [(S(1),), (S(1),), (R,)],
    )
    assert plan.match.in_targets[0] == (S(1),)


def test_growing_cat_reuses_its_decision() -> None:
    """A KV cache growing by ``cat([past, new], -2)``: after the first length, every plan comes from the kept
    decision (no meta execution, no matching) and equals the plan made from scratch; a decision that needed a
    paid redistribute is not kept."""
    from torch_dtorch.placement_rules import rule as rule_mod
    from torch_dtorch.placement_rules.families import cat as cat_mod

    cat_rule = get_rule(aten.cat.default)
    layouts = [
        ((2,), (S(0),), (S(0),)),  # dp: both batch-sharded
        ((2, 2), (S(0), S(1)), (S(0), S(1))),  # dp x tp
        ((2,), (S(0),), (R,)),  # a decode step after the cp prefill: the new token sliced (free)
        ((2,), (S(2),), (S(2),)),  # both sequence-sharded: communicating, still shape-independent
        ((1,), (R,), (R,)),
    ]
    for mesh_shape, past_pl, new_pl in layouts:
        mesh = DeviceMesh("cpu", torch.arange(math.prod(mesh_shape)).view(mesh_shape))
        cat_mod._DECISIONS.clear()
        before = dict(cat_mod.decision_stats)
        for length in range(1, 9):
            sample = Sample(([rand(2, 4, length, 3), rand(2, 4, 1, 3)], -2))
            call = to_call(aten.cat.default, sample, mesh, [past_pl, new_pl])[0]
            got = cat_rule.plan(call)
            rule_mod.clear_plan_cache()
            fresh = rule_mod.OpRule.plan(
                cat_rule, to_call(aten.cat.default, sample, mesh, [past_pl, new_pl])[0]
            )
            assert got.match == fresh.match and got.out_meta == fresh.out_meta, (mesh_shape, past_pl, length)
            assert got.assign == fresh.assign and got.cost == fresh.cost
        hits = cat_mod.decision_stats["hit"] - before["hit"]
        # lengths below the bucket cap (max(2, axis size)) are distinct keys: 1 and then 2.. share one
        assert hits == 6, (mesh_shape, past_pl, new_pl, hits)
    # the past sequence-sharded next to a replicated token: the cache is gathered or moved (paid) - not kept
    cat_mod._DECISIONS.clear()
    mesh = DeviceMesh("cpu", torch.arange(2))
    for length in (4, 5):
        call = to_call(
            aten.cat.default, Sample(([rand(1, 4, length, 3), rand(1, 4, 1, 3)], 2)), mesh, [(S(2),), (R,)]
        )[0]
        cat_rule.plan(call)
    assert not cat_mod._DECISIONS


def test_cat_and_stack_of_partials_stay_partial() -> None:
    plan = check_sample(aten.cat.default, Sample(([rand(5, 3), rand(2, 3)],)), (2,), [(P,), (P,)])
    assert plan.out_placements == ((P,),)
    plan = check_sample(aten.stack.default, Sample(([rand(5, 3), rand(5, 3)],)), (3,), [(P,), (P,)])
    assert plan.out_placements == ((P,),)


def test_stack_shifts_shard_dims_at_or_after_the_new_dim() -> None:
    plan = check_sample(aten.stack.default, Sample(([rand(5, 3), rand(5, 3)], 1)), (2, 2), [(S(0), S(1))] * 2)
    assert plan.out_placements == ((S(0), S(2)),)


def test_flip_repeat_tril_keep_untouched_dims() -> None:
    plan = check_sample(aten.flip.default, Sample((rand(2, 5, 3), [-1])), (2,), [(S(1),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.flip.default, Sample((rand(5, 3), [0])), (2,), [(S(0),)])
    assert plan.match.in_targets != ((S(0),),)
    plan = check_sample(aten.repeat.default, Sample((rand(5, 3), [2, 1, 3])), (3,), [(S(0),)])
    assert plan.out_placements == ((S(1),),)
    plan = check_sample(aten.tril.default, Sample((rand(2, 5, 3),)), (2,), [(S(0),)])
    assert plan.out_placements == ((S(0),),)
    plan = check_sample(aten.triu.default, Sample((rand(5, 3),)), (2,), [(P,)])
    assert plan.out_placements == ((P,),)
