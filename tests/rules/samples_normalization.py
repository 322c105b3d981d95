"""Samples for the normalization family: uneven leading dims, groups that do and do not split evenly."""

from __future__ import annotations

import torch

from tests.rules.harness import Sample

aten = torch.ops.aten
g = torch.Generator().manual_seed(2)


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


X = rand(5, 3, 7)

SAMPLES: dict[object, list[Sample]] = {
    aten.layer_norm.default: [
        Sample((X, [7], rand(7), rand(7))),
        Sample((X, [3, 7]), {"eps": 1e-3}),
        Sample((rand(5, 7), [7], rand(7))),
    ],
    aten.native_layer_norm.default: [
        Sample((X, [7], rand(7), rand(7), 1e-5)),
        Sample((X, [3, 7], None, None, 1e-5)),
    ],
    aten.group_norm.default: [
        Sample((rand(5, 12, 3), 12, rand(12), rand(12))),  # one channel per group: always splits
        Sample((rand(5, 12, 3), 6, rand(12), rand(12))),  # splits over 2 or 3, not nested (2, 2)
        Sample((rand(3, 4), 2, rand(4), None)),
        Sample((rand(3, 8, 2, 3), 4, rand(8), rand(8))),
    ],
    aten.native_group_norm.default: [
        Sample((rand(5, 12, 3), rand(12), rand(12), 5, 12, 3, 6, 1e-5)),
        Sample((rand(3, 6, 2, 3), None, None, 3, 6, 6, 3, 1e-5)),
    ],
    aten._softmax.default: [Sample((X, 1, False)), Sample((X, -1, False))],
    aten._safe_softmax.default: [Sample((X, 1)), Sample((X, -1))],
    aten._log_softmax.default: [Sample((X, 0, False)), Sample((rand(7), 0, False))],
    aten.softmax.int: [Sample((X, -1)), Sample((X, 1, torch.float64))],
    aten.log_softmax.int: [Sample((X, 2)), Sample((X, 0), {"dtype": torch.float64})],
}

if hasattr(aten, "rms_norm"):
    SAMPLES[aten.rms_norm.default] = [
        Sample((X, [7], rand(7), 1e-6)),
        Sample((X, [3, 7])),
        Sample((rand(5, 7), [5, 7], rand(5, 7))),
    ]
