"""Sampling family: ``multinomial`` — what Hugging Face ``generate(do_sample=True)`` calls on the softmax of the
last logits — equal to single-device torch under the same seed.

Signatures (one mesh axis): ``probs [B, V]`` ``S(0)`` -> ``S(0)`` (rows are independent distributions); ``R -> R``.
The category dim is never sharded (a row is one distribution: a vocab-sharded ``probs`` is gathered first).

Random stream: torch draws a value-independent amount of random numbers for the whole tensor — ``n == 1`` or
without replacement: one ``exponential_`` over ``probs``' shape, then ``argmax`` / ``topk`` of ``probs / q``; with
replacement: one uniform per (row, sample) in row order — so each row's samples depend only on that row and on the
generator state. Every rank therefore runs ``torch.multinomial`` on a tensor of the GLOBAL shape (its own rows, the
others filled with a valid uniform distribution) from the state the generator had when the op started
(:func:`~torch_dtorch.placement_rules.families.creation.draw_global`: one snapshot for all ranks, the generator left
where one global draw leaves it) and keeps its rows: the samples equal torch's, and so does the generator's state
afterwards. O(global numel) work per rank, like the random factories. Invalid rows (negative, inf or nan
probabilities, a zero row) raise torch's own error on the rank that holds them.

Where this kernel runs: in **compiled programs** (``torch.compile(backend="dtorch")`` graphs that sample) and in
the reference executors. Eager calls never reach it: the ``dtorch`` device draws ``multinomial`` on the controller
(``device/rng.py``: ``probs`` fetched, torch's own ``multinomial``, the indices uploaded with this rule's output
placements), so eager samples equal torch's in thread and process mode alike. Here the draw happens where the
workers run, from the default generator of their process — the controller's in thread mode. Worker processes
(``mode="process"``) have generators of their own, not seeded by the controller's ``torch.manual_seed``: as for
``dropout``, their samples are valid but do not equal torch's (the known gap of worker-drawn random ops,
``device/rng.py``). A ``generator=`` argument is used as given (thread mode).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.families.creation import draw_global, rank_slice
from torch_dtorch.placement_rules.rule import register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__: list[str] = []

aten = torch.ops.aten
_R = Replicate()


def _kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    probs = args[0]
    x = call.inputs[0]
    assert x is not None
    num_samples, replacement = int(call.arg("num_samples")), bool(call.arg("replacement"))
    generator = call.arg("generator")
    full = probs
    if tuple(probs.shape) != tuple(x.shape):
        # my rows inside the global shape, the others a valid distribution
        full = torch.ones(x.shape, dtype=probs.dtype, device=probs.device)
        full.narrow(0, ctx.out_offsets[0][0], probs.shape[0]).copy_(probs)

    def draw(gen: torch.Generator) -> torch.Tensor:
        return torch.multinomial(full, num_samples, replacement, generator=gen)

    return rank_slice(draw_global(call, ctx, draw, generator), ctx)


@register_rule(aten.multinomial.default, family="sampling", kernel=_kernel)
def multinomial(call: OpCall) -> list[PlacementSignature]:
    """Rows (batch) stay sharded; the categories are whole on every rank."""
    x = call.inputs[0]
    assert x is not None
    return [sig([Shard(0)], Shard(0))] if x.ndim == 2 else []
