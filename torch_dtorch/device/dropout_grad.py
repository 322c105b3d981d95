"""Autograd of ``dropout`` on dtorch tensors: the noise CPU torch draws, so training equals CPU torch under one seed.

``aten.dropout`` is CompositeImplicitAutograd; composite ops decompose when an input requires grad
(``registration._autograd``). torch's decomposition takes the *fused* path for accelerator inputs
(``is_fused_kernel_acceptable``: CUDA, XPU, lazy and **PrivateUse1** tensors) — ``native_dropout``, which has no
dtorch rule (and whose CUDA kernel draws a different stream anyway) — and the unfused path for CPU tensors:
``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p); return x * noise``. A dtorch mesh on the CPU must equal CPU
torch, so :func:`dropout_autograd` runs that unfused path, with the noise drawn by the ``dropout`` rule itself on
the workers: ``dropout(ones_like(x), p, True)`` is ``ones * (bernoulli(1 - p) / (1 - p))``, the same global draw
from the same generator state as CPU torch's ``noise`` (the rule's kernel, ``placement_rules/families/misc.py``),
in ``x``'s placements. ``x * noise`` is then recorded by autograd as in CPU torch (``MulBackward0`` saving the
noise), so forward, gradients and the generator state afterwards equal CPU torch's.

Every other call (no grad, ``train=False``, ``p`` 0 or 1, an empty input) goes to ``default`` (the generic composite
kernel: the whole op without grad, torch's decomposition with it — which for ``p`` 0 or 1 never reaches
``native_dropout``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["dropout_autograd"]

aten = torch.ops.aten


def _draws_with_grad(x: Any, p: float, train: bool) -> bool:
    return (
        torch.is_grad_enabled()
        and isinstance(x, torch.Tensor)
        and x.requires_grad
        and bool(train)
        and 0.0 < p < 1.0
        and x.numel() > 0
    )


def dropout_autograd(default: Callable[..., Any]) -> Callable[..., Any]:
    """The ``AutogradPrivateUse1`` kernel of ``aten.dropout``: CPU torch's unfused path under grad (see the module
    docstring), ``default`` otherwise."""

    def kernel(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        if not _draws_with_grad(input, float(p), train):
            return default(input, p, train)
        with torch.no_grad():
            noise = aten.dropout.default(torch.ones_like(input), p, True)
        out: torch.Tensor = input * noise
        return out

    return kernel
