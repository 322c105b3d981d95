"""Check a rule the DTensor-converter way: shard real inputs per placement combination, run the op's local kernels
on plain torch shards with the rule's chosen signature, assemble the outputs, compare with single-device torch."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torch_dtorch.config import RedistributePolicy
from torch_dtorch.graph import Operand, TensorMeta
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Placement, Placements, Replicate, Shard, local_shape
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.ranks import assemble, coords, distribute, run_all_ranks
from torch_dtorch.placement_rules.rule import OpPlan

MESH_SHAPES: tuple[tuple[int, ...], ...] = ((1,), (2,), (3,), (2, 2))


@dataclass
class Sample:
    """One call of an op on real tensors. ``compare=False`` checks shapes/dtypes only (random ops)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    compare: bool = True
    atol: float = 1e-5
    rtol: float = 1.3e-6
    #: input slots that must never be Partial in the enumeration (e.g. integer index tensors)
    no_partial: bool = False
    #: restrict enumerated placements per slot (None: R, every S(d), P(sum) for floats)
    options: Callable[[int, torch.Tensor], list[Placement]] | None = None
    #: output placement options per mesh axis, requested with ``prefer_outputs`` (factories; one output):
    #: every combination over the mesh axes is checked; None: no preference (the rule's default)
    out_placements: Sequence[Placement] | None = None
    #: outputs whose values torch leaves unspecified (uninitialized workspace, e.g. ``_ctc_loss``'s ``log_alpha``
    #: beyond each target): only their shapes, dtypes and local shapes are checked
    unspecified_outputs: tuple[int, ...] = ()


def to_call(op: Any, sample: Sample, mesh: DeviceMesh, placements: Sequence[Placements | None] | None):
    """OpCall with operands in place of the sample's tensors; returns (call, global tensors per slot)."""
    counter = itertools.count()
    tensors: dict[int, torch.Tensor] = {}

    def wrap(t: torch.Tensor) -> Operand:
        i = next(counter)
        meta = TensorMeta.of(t)
        operand = Operand(i, meta.shape, meta.dtype, mesh, (Replicate(),) * mesh.ndim, stride=meta.stride)
        tensors[id(operand)] = t
        return operand

    args, kwargs = pytree.tree_map_only(torch.Tensor, wrap, (sample.args, sample.kwargs))
    call = OpCall.make(op, args, kwargs, mesh=mesh)
    if placements is not None:
        for i, x in enumerate(call.inputs):
            if x is not None and placements[i] is not None:
                x.placements = tuple(placements[i])  # type: ignore[arg-type]
        call = OpCall.make(op, args, kwargs, mesh=mesh)
    globals_ = [tensors[id(x)] if x is not None else None for x in call.inputs]
    return call, globals_


def slot_options(sample: Sample, slot: int, t: torch.Tensor) -> list[Placement]:
    if sample.options is not None:
        return sample.options(slot, t)
    opts: list[Placement] = [Replicate()] + [Shard(d) for d in range(t.ndim)]
    if t.is_floating_point() and not sample.no_partial:
        opts.append(Partial())
    return opts


def placement_combos(
    sample: Sample, globals_: list[torch.Tensor | None], mesh_ndim: int, limit: int, seed: int
):
    """Up to ``limit`` input placement combinations: the first (all-Replicate), then a seeded random sample drawn
    lazily (the full product can be millions of tuples)."""
    per_slot: list[list[Any]] = []
    for i, t in enumerate(globals_):
        if t is None:
            per_slot.append([None])
        else:
            per_slot.append(list(itertools.product(slot_options(sample, i, t), repeat=mesh_ndim)))
    total = 1
    for options in per_slot:
        total *= len(options)
    if total <= limit:
        return list(itertools.product(*per_slot))
    rng = random.Random(seed)
    picked = {tuple(0 for _ in per_slot)}
    while len(picked) < limit:
        picked.add(tuple(rng.randrange(len(options)) for options in per_slot))
    return [tuple(options[i] for options, i in zip(per_slot, idx)) for idx in sorted(picked)]


def check_sample(
    op: Any,
    sample: Sample,
    mesh_shape: Sequence[int],
    placements: Sequence[Placements | None],
    *,
    policy: RedistributePolicy = RedistributePolicy.AUTO,
    seed: int = 0,
    prefer_outputs: tuple[Placements, ...] | None = None,
) -> OpPlan:
    """Run ``op`` on shards with the rule's plan and compare with torch; returns the plan for extra assertions."""
    mesh = DeviceMesh.from_shape("cpu", tuple(mesh_shape))
    call, globals_ = to_call(op, sample, mesh, placements)
    rule = get_rule(op)
    plan = rule.plan(call, policy=policy, prefer_outputs=prefer_outputs)
    gen = torch.Generator().manual_seed(seed)
    local_inputs: dict[tuple[int, ...], list[torch.Tensor | None]] = {c: [] for c in coords(mesh_shape)}
    for t, target in zip(globals_, plan.match.in_targets, strict=True):
        shards = distribute(t, mesh_shape, target, gen=gen) if t is not None and target is not None else None
        for c in local_inputs:
            local_inputs[c].append(shards[c] if shards is not None else None)
    # the kernels see the call as the runtime gives it: with the matched signature's input placements
    kcall = call.retarget(list(call.inputs), list(plan.match.in_targets))
    outs = run_all_ranks(rule, kcall, plan.out_placements, local_inputs, mesh_shape)
    ref_args, ref_kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (sample.args, sample.kwargs))
    expected = op(*ref_args, **ref_kwargs)  # on clones: in-place ops must not touch the shared sample tensors
    if expected is None and rule.writes_inputs:  # a list op in place (``_foreach_mul_``): the written list
        expected = ref_args[0]
    expected_list = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    expected_list = [e for e in expected_list if isinstance(e, torch.Tensor)]
    where = f"{op} on mesh {tuple(mesh_shape)} with inputs {[_fmt(p) for p in placements]}"
    if prefer_outputs is not None:
        where += f" requesting outputs {[_fmt(p) for p in prefer_outputs]}"
    assert len(expected_list) == len(plan.out_meta), f"{where}: output count"
    for k, (meta, want, pl) in enumerate(zip(plan.out_meta, expected_list, plan.out_placements, strict=True)):
        assert tuple(meta.shape) == tuple(want.shape), (
            f"{where}: inferred shape {meta.shape} != {tuple(want.shape)}"
        )
        assert meta.dtype == want.dtype, f"{where}: inferred dtype {meta.dtype} != {want.dtype}"
        for c in coords(mesh_shape):
            got_shape = tuple(outs[c][k].shape)
            assert got_shape == local_shape(meta.shape, mesh_shape, pl, c), (
                f"{where}: output {k} on rank {c} has local shape {got_shape}, placements {_fmt(pl)} "
                f"imply {local_shape(meta.shape, mesh_shape, pl, c)}"
            )
        if not sample.compare or k in sample.unspecified_outputs:
            continue
        got = assemble({c: outs[c][k] for c in outs}, mesh_shape, pl, check_replicas=True)
        torch.testing.assert_close(
            got,
            want,
            atol=sample.atol,
            rtol=sample.rtol,
            equal_nan=True,
            msg=_prefix(f"{where}: output {k}"),
        )
    return plan


def requested_outputs(sample: Sample, mesh_ndim: int) -> list[tuple[Placements, ...] | None]:
    """The ``prefer_outputs`` values to check: None, or every combination of ``sample.out_placements``."""
    if sample.out_placements is None:
        return [None]
    return [(tuple(c),) for c in itertools.product(sample.out_placements, repeat=mesh_ndim)]


def _prefix(where: str) -> Callable[[str], str]:
    return lambda m: f"{where}: {m}"


def check_op_samples(op: Any, samples: Sequence[Sample], *, limit: int = 24) -> int:
    """Every sample on every mesh shape under a capped set of input placement combinations; returns #checks.

    In-place ops write ``self`` where it is, so a ``self`` placement no signature produces (``abs_`` of a Partial)
    is refused with a PlacementMismatchError — an allowed outcome; every other combination must be exact."""
    from torch_dtorch.errors import PlacementMismatchError

    pinned = bool(get_rule(op).pinned_inputs)
    n = 0
    for si, sample in enumerate(samples):
        for mesh_shape in MESH_SHAPES:
            mesh = DeviceMesh.from_shape("cpu", mesh_shape)
            _, globals_ = to_call(op, sample, mesh, None)
            for combo in placement_combos(sample, globals_, len(mesh_shape), limit, seed=si):
                for wanted in requested_outputs(sample, len(mesh_shape)):
                    try:
                        check_sample(op, sample, mesh_shape, combo, seed=si, prefer_outputs=wanted)
                    except PlacementMismatchError:
                        if not pinned:
                            raise
                        continue
                    n += 1
    return n


def _fmt(p: Placements | None) -> str:
    from torch_dtorch.placement import placements_str

    return "-" if p is None else placements_str(p)
