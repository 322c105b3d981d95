"""``fully_shard``: FSDP-style sharding in the single-controller world.

``dt.fully_shard(module, mesh["dp"])`` keeps every parameter of ``module`` (those no inner ``fully_shard`` took)
``Shard(0)`` on the data-parallel axis, on top of whatever placements the other axes give it (tensor parallelism on
``tp`` composes: ``parallelize_module`` first, then ``fully_shard``). Optimizer state made from the parameters
(``torch.zeros_like``) is sharded the same way, so parameters, gradients and optimizer state at rest take
``1 / dp`` of the memory per device.

For use, a forward pre-hook all-gathers the module's parameters on the dp axis (a differentiable redistribute
``S(0) -> R``) and the module's forward sees the gathered tensors; a forward hook puts the sharded parameters back.
In backward, the gathered parameters' gradients — ``Partial`` over dp when the batch is sharded on dp — are
reduce-scattered into ``Shard(0)`` by the redistribute's backward, so ``param.grad`` is sharded like the parameter.

Differences from upstream FSDP2 (documented in docs/training.md):
- ``reshard_after_forward``: the gathered parameters autograd saves for backward stay alive until backward frees
  them (upstream frees them after forward and gathers again in backward). Under ``torch.no_grad`` they are freed
  right after the module's forward.
- Inputs are not converted: pass dtorch tensors with the batch sharded on dp (``dt.distribute_tensor(x, mesh,
  [Shard(0), ...])``); a plain torch tensor mixed with dtorch parameters is a ``DeviceMismatchError``.
- No mixed precision policy, no CPU offload, no prefetching knobs: the workers run asynchronously already.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch_dtorch.api import redistribute
from torch_dtorch.device.autograd import match_grad_placements
from torch_dtorch.device.kernels import operand_of
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import MeshError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.nn._layout import AxisRef, distribute_param
from torch_dtorch.placement import Placement, Replicate, Shard, placements_str

__all__ = ["FSDPState", "fully_shard"]

log = logging.getLogger("torch_dtorch.nn")

_R = Replicate()


@dataclass
class FSDPState:
    """What ``fully_shard`` attached to a module (``module._dtorch_fsdp``)."""

    axis: AxisRef
    #: (owner module, attribute name) of every parameter this module gathers
    slots: list[tuple[nn.Module, str]] = field(default_factory=list)
    #: the sharded parameters, keyed like ``slots`` (restored after forward)
    saved: dict[tuple[int, str], nn.Parameter] = field(default_factory=dict)


def _sharded_placements(p: torch.Tensor, axis: AxisRef) -> tuple[DeviceMesh, list[Placement]]:
    """``p``'s placements (Replicate for a plain tensor) with ``Shard(0)`` on the dp axis, on the root mesh."""
    root = axis.root
    if is_dtorch(p):
        op = operand_of(p)
        if op.mesh is not None and op.mesh.root != root:
            raise MeshError(
                f"fully_shard: a parameter of shape {tuple(p.shape)} lives on {op.mesh!r}, not on the mesh of the "
                f"dp axis {axis!r}; parallelize the model on one mesh (e.g. mesh['tp'] and mesh['dp'] of one root)"
            )
        current: list[Placement] = list(op.root_placements) if op.mesh is not None else [_R] * root.ndim
    else:
        current = [_R] * root.ndim
    if type(current[axis.root_axis]) is not Replicate:
        raise MeshError(
            f"fully_shard: a parameter of shape {tuple(p.shape)} is already {placements_str(tuple(current))} on "
            f"the dp axis {axis.name!r}; fully_shard needs it Replicate there (shard each module once)"
        )
    current[axis.root_axis] = Shard(0)
    return root, current


def _gathered_placements(p: torch.Tensor, axis: AxisRef) -> list[Placement]:
    pl = list(operand_of(p).root_placements)
    pl[axis.root_axis] = _R
    return pl


def _managed(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Parameters of ``module``'s subtree that no inner ``fully_shard`` manages (each object once)."""
    out: list[tuple[nn.Module, str, nn.Parameter]] = []

    def visit(m: nn.Module) -> None:
        if m is not module and getattr(m, "_dtorch_fsdp", None) is not None:
            return
        for name, p in list(m._parameters.items()):
            if p is None or getattr(p, "_dtorch_fsdp_owner", None) is not None:
                continue
            out.append((m, name, p))
        for child in m.children():
            visit(child)

    visit(module)
    return out


def fully_shard(module: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``module``'s parameters ``Shard(0)`` on ``mesh`` (a 1-d mesh or a 1-d view such as ``mesh["dp"]``);
    gather them for the forward, reduce-scatter their gradients (see the module doc). Call it on inner blocks first,
    then on the root, as upstream. Returns ``module`` (its class is kept)."""
    if getattr(module, "_dtorch_fsdp", None) is not None:
        raise MeshError(f"fully_shard: {type(module).__name__} is already fully sharded")
    if mesh.ndim != 1:
        raise MeshError(
            f"fully_shard: pass the data-parallel axis as a 1-d mesh (mesh['dp']), got {mesh!r} with {mesh.ndim} axes"
        )
    if not reshard_after_forward:
        log.debug("fully_shard: reshard_after_forward=False is the behaviour in training anyway")
    axis = AxisRef(mesh, 0, what="fully_shard")
    state = FSDPState(axis)
    done: dict[int, nn.Parameter] = {}
    for owner, name, p in _managed(module):
        new = done.get(id(p))
        if new is None:
            root, placements = _sharded_placements(p, axis)
            value = distribute_param(p.detach(), root, placements, name=name)
            new = nn.Parameter(value, requires_grad=p.requires_grad)
            new._dtorch_fsdp_owner = module  # type: ignore[attr-defined]
            done[id(p)] = new
        owner.register_parameter(name, new)
        state.slots.append((owner, name))
    match_grad_placements(list(done.values()))
    module._dtorch_fsdp = state  # type: ignore[assignment]
    module.register_forward_pre_hook(_gather_hook(state))
    module.register_forward_hook(_restore_hook(state), always_call=True)
    return module


def _gather_hook(state: FSDPState):  # noqa: ANN202
    def hook(module: nn.Module, args: Any) -> None:
        gathered: dict[int, torch.Tensor] = {}
        for owner, name in state.slots:
            p = owner._parameters.get(name)
            if p is None:  # already swapped (re-entered forward): leave it
                continue
            full = gathered.get(id(p))
            if full is None:
                full = gathered[id(p)] = redistribute(p, state.axis.root, _gathered_placements(p, state.axis))
            state.saved[(id(owner), name)] = p
            del owner._parameters[name]
            object.__setattr__(owner, name, full)
        return None

    return hook


def _restore_hook(state: FSDPState):  # noqa: ANN202
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        for owner, name in state.slots:
            p = state.saved.pop((id(owner), name), None)
            if p is None:
                continue
            owner.__dict__.pop(name, None)
            owner._parameters[name] = p
        return None

    return hook
