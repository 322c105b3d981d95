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
