"""Samples for the ``_foreach_*`` list rules: every ruled overload on lists of two tensors of uneven shapes, values
in (0.1, 0.9) so that every unary op (``log``, ``acos``, ``rsqrt``, ...) is defined."""

from __future__ import annotations

from typing import Any

import torch

from tests.rules.harness import Sample
from torch_dtorch.placement_rules.families.foreach import FOREACH_OPS

g = torch.Generator().manual_seed(11)
SHAPES = ((5, 3), (3,))


def _value(*shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=g) * 0.8 + 0.1


def _args(op: Any) -> tuple[Any, ...]:
    args: list[Any] = []
    for a in op._schema.arguments:
        if a.kwarg_only:
            continue
        t = str(a.type)
        if t == "List[Tensor]":
            args.append([_value(*s) for s in SHAPES])
        elif t == "Tensor":
            args.append(_value())  # the shared 0-dim tensor of ``.Tensor`` overloads
        elif t in ("Scalar", "number"):
            args.append(0.7)
        elif t in ("List[Scalar]", "List[number]"):
            args.append([0.7, 1.3])
        elif a.has_default_value():
            break
        else:
            raise AssertionError(f"{op}: no sample for argument {a.name}: {t}")
    return tuple(args)


SAMPLES: dict[object, list[Sample]] = {op: [Sample(_args(op))] for op in FOREACH_OPS}
