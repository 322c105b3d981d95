"""Samples for the attention family: uneven batch/heads/sequence, broadcast masks, causal, GQA."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement import Partial, Placement, Replicate, Shard

aten = torch.ops.aten
g = torch.Generator().manual_seed(3)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def S(*args: object, **kwargs: object) -> Sample:
    return Sample(tuple(args), dict(kwargs), atol=1e-4, rtol=1e-4)


def _few_mask_options(slot: int, t: torch.Tensor) -> list[Placement]:
    """Keeps the enumerated product of four float slots small: the mask gets R, S(0), S(-2), P only."""
    if slot == 3:
        return [Replicate(), Shard(0), Shard(t.ndim - 2), Partial()]
    return [Replicate(), *(Shard(d) for d in range(t.ndim)), Partial()]


# a boolean mask that never hides a whole row (the diagonal stays visible)
BOOL_MASK = (torch.rand(5, 7, generator=g) > 0.5) | torch.eye(5, 7, dtype=torch.bool)

SAMPLES: dict[object, list[Sample]] = {
    aten.scaled_dot_product_attention.default: [
        S(rand(1, 3, 5, 4), rand(2, 3, 7, 4), rand(2, 1, 7, 3), BOOL_MASK),
        Sample(
            (rand(2, 3, 5, 4), rand(2, 3, 7, 4), rand(2, 3, 7, 3), rand(2, 1, 5, 7)),
            atol=1e-4,
            rtol=1e-4,
            options=_few_mask_options,
        ),
        S(rand(3, 7, 4), rand(3, 5, 4), rand(3, 5, 4), is_causal=True, scale=0.3),
        S(rand(2, 4, 5, 4), rand(2, 2, 7, 4), rand(2, 2, 7, 3), enable_gqa=True),
        S(rand(1, 6, 5, 4), rand(1, 3, 7, 4), rand(1, 3, 7, 4), enable_gqa=True, is_causal=True),
    ],
}


def _rows_and_batch(slot: int, t: torch.Tensor) -> list[Placement]:
    """R, the batch dim and the sequence dim (``-1`` for the log-sum-exp, ``-2`` otherwise), and Partial."""
    seq = t.ndim - 1 if t.ndim == 3 else t.ndim - 2
    return [Replicate(), Shard(0), Shard(seq), Partial()]


def _with_lse(*args: torch.Tensor, causal: bool = False, **kwargs: object) -> list[torch.Tensor]:
    """Consistent forward results (out, lse) for the backward's samples."""
    return list(aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, causal, **kwargs))


_Q, _K, _V, _DO = rand(2, 3, 5, 4), rand(2, 3, 7, 4), rand(2, 3, 7, 4), rand(2, 3, 5, 4)
_OUT, _LSE = _with_lse(_Q, _K, _V)
_QC, _KC, _VC, _DOC = rand(2, 2, 7, 4), rand(2, 2, 7, 4), rand(2, 2, 7, 4), rand(2, 2, 7, 4)
_OUTC, _LSEC = _with_lse(_QC, _KC, _VC, causal=True, scale=0.3)


def _sample(*args: object, **kwargs: object) -> Sample:
    return Sample(tuple(args), dict(kwargs), atol=1e-4, rtol=1e-4, options=_rows_and_batch)


SAMPLES[aten._scaled_dot_product_flash_attention_for_cpu.default] = [
    _sample(_Q, _K, _V, 0.0, False),
    _sample(_QC, _KC, _VC, 0.0, True, scale=0.3),
]
SAMPLES[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = [
    _sample(_DO, _Q, _K, _V, _OUT, _LSE, 0.0, False),
    _sample(_DOC, _QC, _KC, _VC, _OUTC, _LSEC, 0.0, True, scale=0.3),
]
