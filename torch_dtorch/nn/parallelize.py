"""``parallelize_module``: apply a plan of layer styles (ours or upstream ParallelStyles) to a module, and move
every other parameter / buffer to the mesh, replicated.

Plan keys are module paths whose dot-separated atoms are matched with ``fnmatch`` against child names, exactly as
``torch.distributed.tensor.parallel.parallelize_module`` does (``"layers.*.self_attn.q_proj"``; ``""`` is the module
itself). Values are upstream ``ParallelStyle`` objects (translated by reading their attributes), styles of
:mod:`torch_dtorch.nn.styles`, or a parallel layer class of :mod:`torch_dtorch.nn.layers` (the matched
``nn.Linear`` / ``nn.Embedding`` is replaced by that class built from it).

No worker ever holds more than its shard: each parameter is sliced per device on the controller (narrowed views,
so a memory-mapped ``state_dict`` is read shard by shard) and uploaded. A model built on the meta device (for
example under :func:`init_empty_weights`) takes its values from ``state_dict``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn

from torch_dtorch.device.autograd import match_grad_placements
from torch_dtorch.device.heap import freeze_startup_heap
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import DTorchError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.nn import layers
from torch_dtorch.nn._layout import AxisRef, distribute_param, resolve_axis
from torch_dtorch.nn.styles import LayerStyle, from_upstream
from torch_dtorch.placement import Replicate

__all__ = ["init_empty_weights", "parallelize_module", "replicate_module"]

log = logging.getLogger("torch_dtorch.nn")

StateDict = Mapping[str, torch.Tensor]


def _matches(module: nn.Module, path: str, prefix: str) -> Iterator[tuple[str, nn.Module, nn.Module, str]]:
    """(fqn, module, parent, child name) for every submodule matching ``path`` (fnmatch per atom)."""
    head, _, rest = path.partition(".")
    for name, child in module.named_children():
        if not fnmatch(name, head):
            continue
        fqn = f"{prefix}.{name}" if prefix else name
        if rest:
            yield from _matches(child, rest, fqn)
        else:
            yield fqn, child, module, name


_LAYER_CLASSES = (layers.Linear, layers.Embedding)


def _apply_layer_class(
    cls: type[nn.Module], module: nn.Module, mesh: DeviceMesh, axis: AxisRef, fqn: str, sd: StateDict | None
) -> nn.Module:
    if sd is not None:  # values from the state dict (the module may be on meta)
        for pname, p in list(module.named_parameters(recurse=False)):
            key = f"{fqn}.{pname}" if fqn else pname
            if key in sd:
                setattr(module, pname, nn.Parameter(sd[key].to(p.dtype), requires_grad=p.requires_grad))
    if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
        raise DTorchError(
            f"parallelize_module: {fqn} ({type(module).__name__}) is on the meta device and state_dict has no "
            "values for it; pass state_dict="
        )
    tp_dim = mesh.root_axes.index(axis.root_axis)
    if issubclass(cls, layers.Linear) and isinstance(module, nn.Linear):
        return cls.from_linear(module, device_mesh=mesh, tp_dim=tp_dim)
    if issubclass(cls, layers.Embedding) and isinstance(module, nn.Embedding):
        return cls.from_embedding(module, device_mesh=mesh, tp_dim=tp_dim)
    raise NotImplementedError(
        f"parallelize_module: {cls.__name__} cannot replace {fqn} ({type(module).__name__}); layer classes "
        "replace nn.Linear (Linear variants) and nn.Embedding (Embedding variants)"
    )


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh,
    parallelize_plan: Any = None,
    *,
    state_dict: StateDict | None = None,
    tp_dim: int | str | None = None,
    replicate_rest: bool = True,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Parallelize ``module`` on ``device_mesh`` following ``parallelize_plan``; returns the module.

    Args:
        module: the model (on the CPU, on the meta device with ``state_dict``, or already on ``dtorch``).
        device_mesh: a 1-d mesh / view (``mesh["tp"]``), or a mesh whose ``tp_dim`` axis the styles act on.
        parallelize_plan: ``{module path pattern: style}``, or one style for ``module`` itself.
        state_dict: values by fully qualified name (required for meta tensors; may be memory-mapped).
        tp_dim: the axis of ``device_mesh`` the styles act on (default: the only axis, else ``"tp"``).
        replicate_rest: move every parameter and buffer no style placed to the mesh, Replicate.
        src_data_rank: accepted for upstream compatibility; the controller holds the source, so it is unused.
    """
    del src_data_rank
    axis = resolve_axis(device_mesh, tp_dim, what="parallelize_module")
    plan: Mapping[str, Any]
    if parallelize_plan is None:
        plan = {}
    elif isinstance(parallelize_plan, Mapping):
        plan = parallelize_plan
    else:
        plan = {"": parallelize_plan}
    for path, style in plan.items():
        targets = [("", module, None, "")] if path == "" else list(_matches(module, path, ""))
        if not targets:
            log.warning("parallelize_module: plan key %r matches no submodule; skipped", path)
            continue
        for fqn, sub, parent, child in targets:
            if isinstance(style, type) and issubclass(style, _LAYER_CLASSES):
                new = _apply_layer_class(style, sub, device_mesh, axis, fqn, state_dict)
                if parent is None:
                    raise DTorchError("parallelize_module: a layer class cannot replace the root module")
                setattr(parent, child, new)
                continue
            ours = from_upstream(style)
            assert isinstance(ours, LayerStyle)
            ours.apply(sub, axis, fqn=fqn, state_dict=state_dict)
    if replicate_rest:
        replicate_module(module, device_mesh.root, state_dict=state_dict)
    match_grad_placements(module)  # gradients arrive in their parameters' placements (Partial reduced)
    return module


def replicate_module(
    module: nn.Module, mesh: DeviceMesh, *, state_dict: StateDict | None = None
) -> nn.Module:
    """Move every parameter and buffer that is not a dtorch tensor yet onto ``mesh``, Replicate (tied
    parameters stay tied). Meta tensors take their values from ``state_dict``."""
    done: dict[int, Any] = {}
    root = mesh.root
    rep = [Replicate()] * root.ndim
    for mname, sub in module.named_modules(remove_duplicate=False):
        for pname, p in list(sub.named_parameters(recurse=False)):
            if is_dtorch(p) and not _unbound(p):
                continue
            key = id(p)
            if key not in done:
                full = f"{mname}.{pname}" if mname else pname
                done[key] = distribute_param(p, root, rep, name=full, state_dict=state_dict)
            sub.register_parameter(pname, done[key])
        for bname, b in list(sub.named_buffers(recurse=False)):
            if b is None or (is_dtorch(b) and not _unbound(b)):
                continue
            key = id(b)
            if key not in done:
                full = f"{mname}.{bname}" if mname else bname
                done[key] = distribute_param(b, root, rep, name=full, state_dict=state_dict)
            persistent = bname not in getattr(sub, "_non_persistent_buffers_set", set())
            sub.register_buffer(bname, done[key], persistent=persistent)
    match_grad_placements(module)
    freeze_startup_heap("replicate_module")
    return module


def _unbound(t: torch.Tensor) -> bool:
    from torch_dtorch.device.dispatch import operand_of

    return operand_of(t).mesh is None


@contextlib.contextmanager
def init_empty_weights() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real (like ``accelerate``): nothing is
    allocated for weights; :func:`parallelize_module` with ``state_dict=`` then gives each worker its shard.
    Non-persistent buffers (rotary tables) keep the values the module computed."""
    old = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        old(self, name, param)
        if param is not None and param.device.type != "meta":
            kwargs = {"requires_grad": param.requires_grad}
            self._parameters[name] = type(param)(param.to("meta"), **kwargs)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = old  # type: ignore[method-assign]
