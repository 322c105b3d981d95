"""Autograd through the operations of dtorch that are not aten ops: ``redistribute`` (and everything built on it:
``distribute_tensor`` of a dtorch tensor, ``redistribute_by_dict``, the input/output conversions of the parallel
styles and layers) is an ``autograd.Function``, so ``loss.backward()`` flows through placement changes as it does
through upstream DTensor's ``Redistribute``; ``full_tensor()`` of a tensor that requires grad is differentiable too
(its gradient is distributed back); and :func:`match_grad_placements` keeps parameter gradients in their
parameter's placements.

Backward of a redistribute ``A -> B`` redistributes the gradient ``B -> A``, except that a ``Partial`` in ``A``
becomes ``Replicate`` (the gradient of a sum is the same on every term), as upstream does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.device.transfer import fetch, move, upload
from torch_dtorch.graph.operand import contiguous_strides
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, is_partial

__all__ = ["full_tensor_with_grad", "match_grad_placements", "redistribute"]

log = logging.getLogger(__name__)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, t: torch.Tensor, mesh: DeviceMesh | None, placements: Sequence[Placement] | None
    ) -> torch.Tensor:
        src = operand_of(t)
        ctx.src_mesh = src.mesh
        ctx.src_placements = src.placements
        return move(t, mesh, placements)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:  # type: ignore[override]
        if grad is None:
            return None, None, None
        if (
            ctx.src_mesh is None
        ):  # an unbound (Replicate) input: the gradient is Replicate on the output's mesh
            return redistribute(grad, None, None), None, None
        back = [Replicate() if is_partial(p) else p for p in ctx.src_placements]
        return redistribute(grad, ctx.src_mesh, back), None, None


def redistribute(
    t: torch.Tensor, mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None
) -> torch.Tensor:
    """``t`` with other placements (or on another mesh); recorded by autograd when ``t`` requires grad and grad
    mode is on (backward redistributes the gradient back)."""
    if t.requires_grad and torch.is_grad_enabled():
        return _Redistribute.apply(t, mesh, placements)
    return move(t, mesh, placements)


class _FullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        src = operand_of(t)
        ctx.src_mesh = src.mesh
        ctx.src_placements = src.placements
        return fetch(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        if grad is None:
            return None
        if ctx.src_mesh is None:
            return grad.to("dtorch")
        back = [Replicate() if is_partial(p) else p for p in ctx.src_placements]
        return upload(grad, ctx.src_mesh, back, what="full_tensor (backward)")


def full_tensor_with_grad(t: torch.Tensor) -> torch.Tensor:
    """``t.full_tensor()`` recorded by autograd: the gradient (a torch tensor) goes back distributed in ``t``'s
    placements (``Partial`` as ``Replicate``), as upstream's ``DTensor.full_tensor``."""
    return _FullTensor.apply(t)


def _grad_hook(param: torch.Tensor):  # noqa: ANN202
    """A tensor hook moving an incoming gradient to ``param``'s placements (Partial reduced), laid out as ``param``.

    Layout: torch's ``AccumulateGrad`` stores a gradient whose strides differ from its parameter's as a copy with
    the parameter's strides. dtorch tensors report contiguous strides on the controller, so it never copies — a
    weight's gradient through ``linear``'s ``t()`` stayed a transposed view on the workers, and the optimizer's
    ``_foreach_*`` kernels fell back to one strided kernel per tensor (issue 24: 15 ``addcmul`` of 0.6 ms per
    Llama training step on an H100). The hook makes that copy (``clone(memory_format=contiguous_format)``) where the
    gradient's operand is strided and the parameter's is not."""
    ref = weakref.ref(param)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        p = ref()
        if p is None or not is_dtorch(grad) or not is_dtorch(p):
            return grad
        want, have = operand_of(p), operand_of(grad)
        if want.mesh is not None and not (
            have.mesh is not None
            and have.mesh.root == want.mesh.root
            and have.root_placements == want.root_placements
        ):
            with torch.no_grad():
                grad = redistribute(grad, want.mesh, list(want.placements))
            have = operand_of(grad)
        if (
            have.stride is not None
            and have.stride != want.stride
            and want.stride == contiguous_strides(want.shape)
        ):
            with torch.no_grad():
                grad = grad.clone(memory_format=torch.contiguous_format)
        return grad

    return hook


def match_grad_placements(params: Any) -> int:
    """Make every dtorch parameter in ``params`` (a module, or an iterable of tensors) receive its gradients in its
    own placements: a ``Partial`` gradient (data or tensor parallel) is reduced (all-reduce, or reduce-scatter for a
    sharded parameter) and a gradient sharded otherwise is moved, before it is accumulated into ``.grad``.
    Idempotent; returns how many parameters got the hook. ``parallelize_module`` and ``fully_shard`` call it."""
    tensors = params.parameters() if isinstance(params, torch.nn.Module) else params
    n = 0
    for p in tensors:
        if not isinstance(p, torch.Tensor) or not is_dtorch(p) or not p.requires_grad:
            continue
        if getattr(p, "_dtorch_grad_hook", False):
            continue
        p.register_hook(_grad_hook(p))
        p._dtorch_grad_hook = True  # type: ignore[attr-defined]
        n += 1
    return n
