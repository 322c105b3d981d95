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

``reshard_after_forward=True`` (the default, as upstream): while the module's forward runs, a
``saved_tensors_hooks`` pair replaces every tensor autograd saves that is a gathered parameter — or a chain of views
of one (``weight.t()`` saved by ``linear``) — by a reference to the sharded parameter; backward gathers it again
(and replays the views) when it needs it. So the gathered parameters die after the forward and only the shards stay
alive between forward and backward. A saved tensor *computed* from a gathered parameter (a dtype cast) is kept as is.
``False`` keeps the gathered parameters saved until backward (no second all-gather). Under ``torch.no_grad`` they are
freed right after the module's forward either way.

Differences from upstream FSDP2 (documented in docs/training.md):
- Inputs are not converted: pass dtorch tensors with the batch sharded on dp (``dt.distribute_tensor(x, mesh,
  [Shard(0), ...])``); a plain torch tensor mixed with dtorch parameters is a ``DeviceMismatchError``.
- No mixed precision policy, no CPU offload, no prefetching knobs: the workers run asynchronously already.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from torch_dtorch.api import redistribute
from torch_dtorch.device.autograd import match_grad_placements
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.heap import freeze_startup_heap
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import DTorchError, MeshError
from torch_dtorch.graph import ViewInfo
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
    reshard_after_forward: bool = True
    #: the gathered operands' ids of the running forward (removed from :data:`_GATHERED` after it)
    gathered_ids: list[int] = field(default_factory=list)
    #: the ``saved_tensors_hooks`` context of the running forward
    hooks: Any = None


class _Resharded(NamedTuple):
    """What autograd keeps instead of a gathered parameter (or a view of one): gathered again in backward."""

    param: torch.Tensor
    root: DeviceMesh
    placements: tuple[Placement, ...]
    views: tuple[ViewInfo, ...]


#: gathered operand id -> (sharded parameter, root mesh, gathered placements), during the forwards that run
_GATHERED: dict[int, tuple[torch.Tensor, DeviceMesh, tuple[Placement, ...]]] = {}


def _pack(t: torch.Tensor) -> Any:
    if not _GATHERED or not is_dtorch(t):
        return t
    try:
        op = operand_of(t)
    except DTorchError:
        return t
    chain: list[ViewInfo] = []
    while op.id not in _GATHERED:
        if op.base is None or op.view is None:
            return t
        chain.append(op.view)
        op = op.base
    param, root, placements = _GATHERED[op.id]
    return _Resharded(param, root, placements, tuple(reversed(chain)))


def _unpack(x: Any) -> torch.Tensor:
    if not isinstance(x, _Resharded):
        return x
    with torch.no_grad():
        t = redistribute(x.param.detach(), x.root, list(x.placements))
        for v in x.views:
            t = v.op(t, *v.args)  # type: ignore[operator]
    return t


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
    axis = AxisRef(mesh, 0, what="fully_shard")
    state = FSDPState(axis, reshard_after_forward=reshard_after_forward)
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
    freeze_startup_heap("fully_shard")
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
                placements = _gathered_placements(p, state.axis)
                full = gathered[id(p)] = redistribute(p, state.axis.root, placements)
                if state.reshard_after_forward and torch.is_grad_enabled():
                    gid = operand_of(full).id
                    _GATHERED[gid] = (p, state.axis.root, tuple(placements))
                    state.gathered_ids.append(gid)
            state.saved[(id(owner), name)] = p
            del owner._parameters[name]
            object.__setattr__(owner, name, full)
        if state.gathered_ids and state.hooks is None:
            state.hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
            state.hooks.__enter__()
        return None

    return hook


def _restore_hook(state: FSDPState):  # noqa: ANN202
    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        if state.hooks is not None:
            state.hooks.__exit__(None, None, None)
            state.hooks = None
        for gid in state.gathered_ids:
            _GATHERED.pop(gid, None)
        state.gathered_ids.clear()
        for owner, name in state.slots:
            p = state.saved.pop((id(owner), name), None)
            if p is None:
                continue
            owner.__dict__.pop(name, None)
            owner._parameters[name] = p
        return None

    return hook
