"""Complex views: ``view_as_real(z [*]) -> [*, 2]`` (``view_as_complex``, its inverse, lives in ``view_scatter.py``).

Signatures (one mesh axis): ``S(d) -> S(d)`` for every dim of ``z`` (the new trailing real/imaginary pair is never
sharded); ``P -> P`` (the view is linear). Together with the pointwise rules (complex ``mul``, ``polar``), this runs
rotary embeddings in their complex form (Llama-2's ``apply_rotary_emb``) and their backward, which autograd writes
with the other view.
"""

from __future__ import annotations

import torch

from torch_dtorch.placement import Placement, Shard
from torch_dtorch.placement_rules.call import OpCall
from torch_dtorch.placement_rules.families.view import _zero_cost, distinct_partials
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__: list[str] = []

aten = torch.ops.aten


@register_rule(aten.view_as_real.default, family="complex", intercept=True, view_of=0, cost=_zero_cost)
def view_as_real(call: OpCall) -> list[PlacementSignature]:
    """Every dim of the complex input keeps its place; Partial stays Partial."""
    z = call.inputs[0]
    assert z is not None
    heads: list[tuple[Placement, Placement]] = [(Shard(d), Shard(d)) for d in range(z.ndim)]
    heads += [(p, p) for p in distinct_partials(call.placements[0])]
    return [sig([i], o) for i, o in heads]
