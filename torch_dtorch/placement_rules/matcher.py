"""Per-mesh-axis matching of input placements against an op's signatures.

On every mesh axis independently: a signature whose inputs equal the current placements wins at once (first in the
rule's order). Otherwise, when the redistribute policy allows, the signature that is cheapest to reach is chosen
(DTensor-style cost ordering): Replicate->Shard is a local slice and costs nothing, which is what aligns a
replicated operand with a sharded peer in a broadcasting binary op. Before the cost comes the work split: a
signature that shards a dim smaller than the axis (some ranks would get empty shards and the work stays on the
others) is chosen only when no other is reachable — an all-to-all of a sequence shard goes to the heads, not to a
batch dim of size 1, and a convolution whose rows cannot stay sharded gathers them rather than moving them to that
batch dim (the work then splits again downstream: R -> S is a local slice). Under ``DTORCH_REDISTRIBUTE=never``
(or when no signature is reachable) a :class:`PlacementMismatchError` lists every argument and the legal
signatures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch_dtorch.config import RedistributePolicy
from torch_dtorch.errors import PlacementMismatchError
from torch_dtorch.placement import Placement, Placements, Replicate, Shard, is_partial, placements_str
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.signature import PlacementSignature

__all__ = ["Match", "match", "transition_cost"]

_R = Replicate()


def transition_cost(src: Placement, dst: Placement, nbytes: int, axis_size: int) -> float | None:
    """Estimated bytes moved per rank to turn ``src`` into ``dst`` on one mesh axis (``None``: not possible)."""
    if src == dst or axis_size == 1:
        return 0.0
    frac = (axis_size - 1) / axis_size
    if type(src) is Replicate:
        return 0.0  # R->S local slice, R->P zero-fill
    if type(src) is Shard:
        if type(dst) is Shard:
            return nbytes * frac / axis_size  # all-to-all
        return nbytes * frac  # all-gather (then zero-fill for P)
    if is_partial(src):
        if type(dst) is Shard:
            return nbytes * frac  # reduce-scatter
        return 2 * nbytes * frac  # all-reduce (then zero-fill for another P)
    return None


def _is_local(src: Placement, dst: Placement) -> bool:
    return src == dst or type(src) is Replicate


@dataclass(frozen=True)
class Match:
    """Chosen signature per mesh axis, the placements inputs must have, and the outputs' placements."""

    chosen: tuple[PlacementSignature, ...]
    in_targets: tuple[Placements | None, ...]
    out_placements: tuple[Placements, ...]

    def needs_redistribute(self, call: OpCall) -> list[int]:
        return [
            i
            for i, (cur, tgt) in enumerate(zip(call.placements, self.in_targets, strict=True))
            if cur is not None and tgt is not None and tuple(cur) != tuple(tgt)
        ]


def match(
    call: OpCall,
    signatures: Sequence[PlacementSignature],
    policy: RedistributePolicy,
    *,
    prefer_outputs: tuple[Placements, ...] | None = None,
    pinned: Sequence[int] = (),
) -> Match:
    mesh_shape = call.mesh.shape if call.mesh is not None else ()
    num_slots = len(call.inputs)
    num_outputs = len(call.out_meta)
    chosen: list[PlacementSignature] = []
    for axis, size in enumerate(mesh_shape):
        current = [p[axis] if p is not None else None for p in call.placements]
        best: tuple[int, float, int, int, int] | None = None
        best_sig: PlacementSignature | None = None
        wanted = tuple(p[axis] for p in prefer_outputs) if prefer_outputs is not None else None
        for order, s in enumerate(signatures):
            if len(s.inputs) != num_slots or len(s.outputs) != num_outputs:
                continue
            if wanted is not None and s.outputs != wanted:
                continue
            if any(current[i] is not None and s.inputs[i] != current[i] for i in pinned):
                continue
            if s.matches(current):
                best_sig = s
                break
            if policy is RedistributePolicy.NEVER:
                continue
            total = 0.0
            moves = 0
            ok = True
            for x, cur, dst in zip(call.inputs, current, s.inputs, strict=True):
                if x is None or cur is None or cur == dst:
                    continue
                if policy is RedistributePolicy.LOCAL and not _is_local(cur, dst):
                    ok = False
                    break
                c = transition_cost(cur, dst, x.nbytes(), size)
                if c is None:
                    ok = False
                    break
                total += c
                moves += 1
            # first fewer shards with empty ranks (a dim smaller than the axis: one rank would hold the work), then
            # the bytes moved; ties: fewer moves, then fewer Partial outputs (a gathered input should not come out
            # Partial)
            starved = _starved(call, s, size)
            partial_out = sum(1 for p in s.outputs if is_partial(p))
            if ok and (best is None or (starved, total, moves, partial_out, order) < best):
                best, best_sig = (starved, total, moves, partial_out, order), s
        if best_sig is None:
            if wanted is not None:
                raise _unreachable_output(call, signatures, axis, wanted)
            raise _mismatch(call, signatures, axis, policy)
        chosen.append(best_sig)
    in_targets: list[Placements | None] = []
    for i in range(num_slots):
        if call.inputs[i] is None:
            in_targets.append(None)
        else:
            in_targets.append(tuple(s.inputs[i] for s in chosen))
    outs = tuple(tuple(s.outputs[k] for s in chosen) for k in range(num_outputs))
    return Match(tuple(chosen), tuple(in_targets), outs)


def _starved(call: OpCall, s: PlacementSignature, size: int) -> int:
    """How many of ``s``'s sharded inputs and outputs split a dim smaller than the axis ``size`` (some ranks
    would get an empty shard: e.g. the batch dim of size 1 while the heads divide)."""
    shapes = [x.shape if x is not None else None for x in call.inputs] + [m.shape for m in call.out_meta]
    return sum(
        1
        for shape, p in zip(shapes, (*s.inputs, *s.outputs), strict=True)
        if shape is not None
        and type(p) is Shard
        and -len(shape) <= p.dim < len(shape)
        and shape[p.dim] < size
    )


def _mismatch(
    call: OpCall, signatures: Sequence[PlacementSignature], axis: int, policy: RedistributePolicy
) -> PlacementMismatchError:
    args = []
    for i, x in enumerate(call.inputs):
        if x is None:
            continue
        pl = call.placements[i] or ()
        args.append(
            f"input {i}: {x.type_str()} {placements_str(pl)} (axis {axis}: {placements_str(pl[axis : axis + 1])})"
        )
    legal = [str(s) for s in signatures if len(s.inputs) == len(call.inputs)]
    if policy is RedistributePolicy.NEVER:
        reason = (
            f"the inputs' placements on mesh axis {axis} match no signature and DTORCH_REDISTRIBUTE=never"
        )
        fix = (
            "redistribute the inputs to one of the legal signatures first, or allow DTORCH_REDISTRIBUTE=auto"
        )
    else:
        reason = (
            f"the inputs' placements on mesh axis {axis} match no signature and none is reachable under "
            f"DTORCH_REDISTRIBUTE={policy.value}"
        )
        fix = "redistribute the inputs to one of the legal signatures first, or set DTORCH_REDISTRIBUTE=auto"
    return PlacementMismatchError(
        call.op, arguments=args, axis=axis, signatures=legal, reason=reason, fix=fix
    )


def _unreachable_output(
    call: OpCall, signatures: Sequence[PlacementSignature], axis: int, wanted: tuple[Placement, ...]
) -> PlacementMismatchError:
    outs = ", ".join(placements_str((p,)) for p in wanted)
    return PlacementMismatchError(
        call.op,
        arguments=[f"output {k}: {m.shape}" for k, m in enumerate(call.out_meta)],
        axis=axis,
        signatures=[str(s) for s in signatures],
        reason=f"cannot produce the requested output placement {outs} on mesh axis {axis}",
        fix="request one of the output placements listed, then redistribute the result",
    )
