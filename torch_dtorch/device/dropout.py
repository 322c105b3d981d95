"""Eager ``dropout`` and ``native_dropout`` on dtorch tensors: the noise is drawn on the **controller**, from torch's
own generator, when the op is recorded — so training equals CPU torch under one seed in thread and process mode.

Where the noise comes from. The ``dropout`` / ``native_dropout`` rules (``placement_rules/families/misc.py``) draw
on the workers (the global draw, each rank keeping its slice, :func:`~torch_dtorch.placement_rules.families.creation.
draw_global`), from the default generator of the process they run in. In thread mode that is the controller's, so
the draw equals CPU torch's — but in process mode every worker process has a generator of its own, never seeded by
the controller's ``torch.manual_seed``: the masks were valid but not CPU torch's, and ``torch.get_rng_state()`` did
not move. The eager kernels here therefore draw the way ``rand``/``bernoulli_`` already do (``device/dispatch.py``
``RANDOM_OPS``, ``device/rng.py`` ``random_inplace``): CPU torch's own recipe, run on the controller device at the
time of the call, then uploaded in the input's placements (a ``Partial`` input gets a ``Replicate`` noise: one mask
for every part keeps dropout linear). Results, gradients and the generator's state afterwards equal single-device
torch, and a ``manual_seed`` after the call no longer changes a draw the workers have not run yet. Cost: the global
draw on the controller (what single-device torch pays) plus the upload of each rank's block (O(shard) per worker,
instead of O(global) per worker for a worker-side draw).

The recipes (ATen ``Dropout.cpp``):

- ``dropout`` (:func:`dropout_kernel`): ``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p); x * noise`` — CPU
  torch's unfused path, also under grad: torch's decomposition of ``dropout`` would take the *fused* path for
  accelerator inputs (``is_fused_kernel_acceptable``: CUDA, XPU, lazy and **PrivateUse1** tensors), i.e.
  ``native_dropout``; :func:`dropout_autograd` records ``x * noise`` instead, as CPU torch does (``MulBackward0``
  saving the noise), so gradients are CPU torch's bit for bit.
- ``native_dropout`` (:func:`native_dropout_kernel`): ``mask = empty_like(x, dtype=bool).bernoulli_(1 - p);
  (x.mul(mask).mul_(1 / (1 - p)), mask)``; its autograd is torch's (``native_dropout_backward``).
- ``dropout_``, ``feature_dropout`` / ``dropout1d-3d``, ``alpha_dropout``, ``feature_alpha_dropout`` are composite
  and decompose (with or without grad) into ``empty_like`` / ``new_empty`` + ``bernoulli_`` + pointwise ops:
  ``bernoulli_`` is already drawn on the controller (``random_inplace``), so they equal CPU torch as they are.

Every other call (``train=False``, ``p`` 0 or 1 for ``dropout``, an empty input, a call under a dispatch mode such
as ``torch.compile``'s tracing) goes to the generic kernel (the rule: the identity, or ``x * 0`` for ``p = 1``).
Compiled programs run the rules' worker-side draw (see docs/training.md "Dropout").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_dtorch._compat import dispatch_mode_depth
from torch_dtorch.device.dispatch import controller_device
from torch_dtorch.device.rng import upload_like
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import TABLE

__all__ = ["dropout_autograd", "dropout_kernel", "native_dropout_kernel"]

aten = torch.ops.aten


def _draws(x: Any, train: bool | None) -> bool:
    """Whether a real eager call (not one traced under a dispatch mode) of a non-empty input trains."""
    return (
        (train is None or bool(train))
        and isinstance(x, torch.Tensor)
        and x.numel() > 0
        and not dispatch_mode_depth()
    )


def _bernoulli_like(x: torch.Tensor, p: float, dtype: torch.dtype | None = None) -> tuple[Any, torch.Tensor]:
    """CPU torch's ``empty_like(x, dtype=dtype).bernoulli_(1 - p)`` on the controller device (``x``'s global shape
    and strides, ``empty_like``'s preserve-format layout, so the draw order is torch's), with ``x``'s operand."""
    rt = get_session()
    operand = TABLE.lookup(x, rt.generation)
    like = torch.empty_strided(
        operand.shape, operand.stride or (), dtype=dtype or operand.dtype, device="meta"
    )
    return operand, torch.empty_like(like, device=controller_device(rt)).bernoulli_(1 - p)


def controller_noise(x: torch.Tensor, p: float) -> torch.Tensor:
    """``dropout``'s noise ``empty_like(x).bernoulli_(1 - p).div_(1 - p)``, drawn on the controller and uploaded in
    ``x``'s placements (a dtorch tensor)."""
    operand, noise = _bernoulli_like(x, p)
    return upload_like(operand, noise.div_(1 - p))


def dropout_kernel(generic: Callable[..., Any]) -> Callable[..., Any]:
    """The ``PrivateUse1`` kernel of ``aten.dropout`` (no grad, or under ``inference_mode``): ``x * noise`` with the
    noise of :func:`controller_noise`; ``generic`` for calls that draw nothing."""

    def kernel(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        if not (0.0 < float(p) < 1.0 and _draws(input, train)):
            return generic(input, p, train)
        out: torch.Tensor = input * controller_noise(input, float(p))
        return out

    return kernel


def native_dropout_kernel(generic: Callable[..., Any]) -> Callable[..., Any]:
    """The ``PrivateUse1`` kernel of ``aten.native_dropout``: CPU torch's kernel with the mask drawn on the
    controller (``bool``, uploaded in ``x``'s placements); ``generic`` for calls that draw nothing."""

    def kernel(input: torch.Tensor, p: float, train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        p = float(p)
        if not (0.0 <= p <= 1.0 and _draws(input, train)):  # (a bad ``p`` gets the rule's error)
            out: tuple[torch.Tensor, torch.Tensor] = generic(input, p, train)
            return out
        operand, mask = _bernoulli_like(input, p, torch.bool)  # drawn for p = 0 and 1 too, as CPU torch does
        dmask = upload_like(operand, mask)
        return input.mul(dmask).mul_(0.0 if p == 1.0 else 1.0 / (1.0 - p)), dmask

    return kernel


def dropout_autograd(default: Callable[..., Any]) -> Callable[..., Any]:
    """The ``AutogradPrivateUse1`` kernel of ``aten.dropout``: under grad, ATen's ``_dropout_impl`` — ``x`` itself
    without training (or for ``p = 0``, an empty ``x``), ``x * 0`` for ``p = 1``, else CPU torch's unfused path
    ``x * noise`` recorded by autograd (see the module docstring). Without grad, or for a bad ``p`` (the rule's
    error), ``default``. (torch's Python decomposition of ``dropout``, which ``default`` runs under grad, would call
    ``native_dropout`` for ``p = 1``, which draws: CPU torch's ``dropout`` does not.)"""

    def kernel(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        grad = torch.is_grad_enabled() and isinstance(input, torch.Tensor) and input.requires_grad
        if not (grad and 0.0 <= float(p) <= 1.0) or dispatch_mode_depth():
            return default(input, p, train)
        if not train or float(p) == 0.0 or input.numel() == 0:
            return input
        if float(p) == 1.0:
            zero = torch.zeros((), dtype=input.dtype, device=input.device)
            return input * zero
        with torch.no_grad():
            noise = controller_noise(input, float(p))
        out: torch.Tensor = input * noise
        return out

    return kernel
