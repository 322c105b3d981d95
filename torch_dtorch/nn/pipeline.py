"""Pipeline parallelism: stage meshes from ``mesh.unbind("pp")``, layers placed on their stage, activations moved
between stages automatically, micro-batches that overlap.

- :func:`assign_layers_to_stages` splits ``num_layers`` into contiguous, balanced stages.
- :func:`pipeline_parallel` places every module of a model on a stage mesh (a TP plan, if given, is applied inside
  each stage on the stage's ``tp`` axis) and installs a forward pre-hook on every stage-owned module that moves its
  dtorch tensor arguments (nested in tuples / lists / dicts / kwargs too: hidden states, rotary tables, masks) to
  the stage mesh with a point-to-point redistribute, keeping their placements. Tensors the model creates without a
  mesh (``torch.arange(..., device=x.device)``) stay unbound and bind to the stage that first uses them.
- :func:`pipeline_forward` splits a batch into micro-batches and issues them back to back: every op returns at
  once and each stage's workers run asynchronously, so stage ``s`` works on micro-batch ``m`` while stage ``s+1``
  works on ``m-1`` (no schedule object needed for forward passes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from torch_dtorch._tree import map_only
from torch_dtorch.api import redistribute
from torch_dtorch.backend.place import STAGE_MOVE, mesh_key, place
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import DTorchError, MeshError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate

__all__ = ["PipelineStages", "assign_layers_to_stages", "pipeline_forward", "pipeline_parallel", "to_stage"]

log = logging.getLogger("torch_dtorch.nn")


def assign_layers_to_stages(num_layers: int, num_stages: int) -> list[int]:
    """Stage index of every layer: contiguous blocks, sizes differing by at most one (earlier stages larger)."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"assign_layers_to_stages: need 1 <= num_stages <= num_layers, got {num_layers} layers and "
            f"{num_stages} stages"
        )
    base, extra = divmod(num_layers, num_stages)
    out: list[int] = []
    for s in range(num_stages):
        out += [s] * (base + (1 if s < extra else 0))
    return out


def to_stage(t: Any, mesh: DeviceMesh) -> Any:
    """``t`` on ``mesh`` (a dtorch tensor on another root mesh is moved point-to-point, keeping its placements when
    the meshes have the same shape, else replicated); anything else passes through."""
    if not is_dtorch(t):
        return t
    op = operand_of(t)
    if op.mesh is None or op.mesh.root == mesh.root:
        return t
    src = op.mesh
    if src.root.shape == mesh.root.shape:
        return redistribute(t, mesh.root, list(op.root_placements))
    return redistribute(t, mesh.root, [Replicate()] * mesh.root.ndim)


class PipelineStages:
    """The result of :func:`pipeline_parallel`: stage meshes, which stage owns each layer, and the hooks."""

    def __init__(self, meshes: list[DeviceMesh], layer_stage: list[int], owners: dict[str, int]) -> None:
        self.meshes = meshes
        self.layer_stage = layer_stage
        self.owners = owners
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        #: the stage meshes' keys inside compiled graphs (``dtorch::place`` stage moves)
        self._keys = [mesh_key(m) for m in meshes]

    @property
    def num_stages(self) -> int:
        return len(self.meshes)

    def move(self, value: Any, stage: int) -> Any:
        """Move every dtorch tensor in ``value`` to ``stage`` (each tensor once per forward and stage)."""
        mesh = self.meshes[stage]
        if torch.compiler.is_compiling():  # placements unknown while tracing: propagation makes the move
            key = self._keys[stage]
            return map_only(
                torch.Tensor,
                lambda t: place(t, key, STAGE_MOVE, what="pipeline stage move") if is_dtorch(t) else t,
                value,
            )

        def conv(t: torch.Tensor) -> Any:
            if not is_dtorch(t):
                return t
            op = operand_of(t)
            if op.mesh is None or op.mesh.root == mesh.root:
                return t
            key = (op.id, stage)
            hit = self._cache.get(key)
            if hit is None:
                hit = self._cache[key] = to_stage(t, mesh)
            return hit

        return map_only(torch.Tensor, conv, value)

    def clear(self) -> None:
        self._cache.clear()


def _owner_fn(
    layers_path: str, layer_stage: Sequence[int], last: int, last_stage: Sequence[str]
) -> Callable[[str], int]:
    prefix = f"{layers_path}." if layers_path else ""

    def owner(fqn: str) -> int:
        if fqn.startswith(prefix):
            idx = fqn[len(prefix) :].split(".", 1)[0]
            if idx.isdigit():
                return layer_stage[int(idx)]
        for name in last_stage:  # a full path, or a unit's own name ("norm" is "model.norm")
            if fqn == name or fqn.startswith(f"{name}.") or fqn.rsplit(".", 1)[-1] == name:
                return last
        return 0

    return owner


def pipeline_parallel(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    pp_dim: str | int = "pp",
    layers: str = "layers",
    last_stage: Sequence[str] = ("norm", "lm_head"),
    assignment: Sequence[int] | None = None,
    plan: Mapping[str, Any] | None = None,
    tp_dim: str | int | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> PipelineStages:
    """Place ``model`` on the stages of ``mesh.unbind(pp_dim)``.

    Args:
        model: the model (CPU, meta with ``state_dict``, or dtorch).
        mesh: the root mesh with a pipeline axis ``pp_dim``.
        layers: path of the ``nn.ModuleList`` of repeated layers, assigned with :func:`assign_layers_to_stages`
            (or ``assignment``, one stage index per layer).
        last_stage: modules beside the layer list that run after the layers (final norm, head), by path or by
            name (``"norm"`` is ``model.norm`` when ``layers="model.layers"``); every other module beside the layer
            list belongs to stage 0 (embeddings, rotary tables). Parameters of the model itself and of the
            modules holding the layer list also live on stage 0: code of theirs that uses them after the last
            stage's units ran mixes meshes (a ``PlacementError``); move such values with :func:`to_stage`.
        plan: a TP plan (``parallelize_module`` keys and styles) applied inside every stage on axis ``tp_dim`` of
            the stage mesh.
    """
    from torch_dtorch.nn.parallelize import parallelize_module, replicate_module

    stages = mesh.unbind(pp_dim)
    layer_list = model.get_submodule(layers)
    if not isinstance(layer_list, (nn.ModuleList, nn.Sequential)):
        raise DTorchError(f"pipeline_parallel: {layers!r} is a {type(layer_list).__name__}, not a ModuleList")
    num_layers = len(layer_list)
    layer_stage = (
        list(assignment) if assignment is not None else assign_layers_to_stages(num_layers, len(stages))
    )
    if len(layer_stage) != num_layers or any(not 0 <= s < len(stages) for s in layer_stage):
        raise ValueError(
            f"pipeline_parallel: assignment {layer_stage} must give one stage in [0, {len(stages)}) per layer "
            f"({num_layers} layers)"
        )
    owner = _owner_fn(layers, layer_stage, len(stages) - 1, last_stage)
    units, containers = _units(model, layers, layer_list)
    owners = {name: owner(name) for name, _ in units}
    result = PipelineStages(stages, layer_stage, owners)
    for s, smesh in enumerate(stages):
        mine = [(name, m) for name, m in units if owners[name] == s]
        if plan:
            if tp_dim is None and smesh.ndim > 1:
                raise MeshError("pipeline_parallel: a plan on a multi-axis stage mesh needs tp_dim=")
            view = smesh if tp_dim is None else smesh[tp_dim] if isinstance(tp_dim, str) else smesh
            for name, m in mine:
                sub_plan = _sub_plan(plan, name)
                sub_sd = _sub_state_dict(state_dict, name)
                if sub_plan:
                    parallelize_module(m, view, sub_plan, state_dict=sub_sd, replicate_rest=False)
        for name, m in mine:
            replicate_module(m, smesh, state_dict=_sub_state_dict(state_dict, name))

            def hook(mod: nn.Module, args: Any, kwargs: Any, s: int = s) -> tuple[Any, Any]:
                return result.move(args, s), result.move(kwargs, s)

            m.register_forward_pre_hook(hook, with_kwargs=True)
    # parameters of the model itself and of the modules holding the layer list (outside every unit): stage 0
    for prefix, container in containers:
        replicate_module_own(
            container, stages[0], _sub_state_dict(state_dict, prefix) if prefix else state_dict
        )
    model.register_forward_pre_hook(lambda mod, args: result.clear())
    log.info("pipeline_parallel: %d layers on %d stages %s", num_layers, len(stages), layer_stage)
    return result


def _units(
    model: nn.Module, layers: str, layer_list: nn.ModuleList | nn.Sequential
) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """The units a stage runs — each layer, and every module beside the layer list on its path (``layers=
    "model.layers"``: ``model.embed_tokens``, ``model.norm``, ``model.rotary_emb``, ``lm_head``) — and the modules
    on that path that hold them (``""``: the model, ``"model"``), each as (fqn, module)."""
    units: list[tuple[str, nn.Module]] = [(f"{layers}.{i}", m) for i, m in enumerate(layer_list)]
    containers: list[tuple[str, nn.Module]] = []
    parent, prefix = model, ""
    for atom in layers.split("."):
        containers.append((prefix.rstrip("."), parent))
        units += [(f"{prefix}{name}", m) for name, m in parent.named_children() if name != atom]
        prefix = f"{prefix}{atom}."
        parent = parent.get_submodule(atom)
    return units, containers


def replicate_module_own(
    model: nn.Module, mesh: DeviceMesh, state_dict: Mapping[str, torch.Tensor] | None
) -> None:
    from torch_dtorch.nn._layout import distribute_param

    rep = [Replicate()] * mesh.ndim
    for pname, p in list(model.named_parameters(recurse=False)):
        if not is_dtorch(p):
            model.register_parameter(pname, distribute_param(p, mesh, rep, name=pname, state_dict=state_dict))  # type: ignore[arg-type]
    for bname, b in list(model.named_buffers(recurse=False)):
        if b is not None and not is_dtorch(b):
            model.register_buffer(bname, distribute_param(b, mesh, rep, name=bname, state_dict=state_dict))


def _sub_plan(plan: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """Plan entries under ``prefix`` (a module path), with the prefix stripped: atoms matched with fnmatch."""
    from fnmatch import fnmatch

    atoms = prefix.split(".")
    out: dict[str, Any] = {}
    for key, style in plan.items():
        parts = key.split(".")
        if len(parts) >= len(atoms) and all(fnmatch(a, p) for a, p in zip(atoms, parts, strict=False)):
            out[".".join(parts[len(atoms) :])] = style
    return out


def _sub_state_dict(
    state_dict: Mapping[str, torch.Tensor] | None, prefix: str
) -> dict[str, torch.Tensor] | None:
    if state_dict is None:
        return None
    p = f"{prefix}."
    return {k[len(p) :]: v for k, v in state_dict.items() if k.startswith(p)}


def pipeline_forward(
    model: Callable[..., Any],
    batch: torch.Tensor,
    *,
    num_microbatches: int,
    mesh: DeviceMesh,
    placements: Sequence[Any] | None = None,
    output: Callable[[Any], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run ``model`` on ``batch`` (a CPU tensor, split along dim 0) in ``num_microbatches`` micro-batches
    distributed on ``mesh`` (stage 0) with ``placements``; returns the concatenated outputs (on the last stage).
    ``output`` picks the tensor from the model's return value (e.g. ``lambda o: o.last_hidden_state``)."""
    from torch_dtorch.api import distribute_tensor

    if is_dtorch(batch):
        raise DTorchError(
            "pipeline_forward: pass the batch as a torch tensor (it is split into micro-batches before it is "
            "distributed, so no sharded dim is sliced)"
        )
    outs = []
    for mb in torch.tensor_split(batch, num_microbatches, dim=0):
        x = distribute_tensor(mb, mesh, placements)
        y = model(x)
        outs.append(output(y) if output is not None else y)
    return torch.cat(outs, dim=0)
