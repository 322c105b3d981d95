"""The mesh a diffusion pipeline runs on: which pipelines are supported (their differences), the roles of the
mesh's named axes (``cfg``, ``cp`` / ``ulysses`` / ``ring``, ``tp``) and the transformer's tensor-parallel shards.
Used by :func:`~torch_dtorch.apps.diffusion.parallelize.parallelize_pipeline` (see its module docstring)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from torch_dtorch.apps.diffusion.config import ExecuteConfig
from torch_dtorch.errors import PipelineParallelError
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Shard

__all__ = ["AXIS_NAMES", "MeshPlan", "plan_mesh", "transformer_tp_plan"]

#: mesh axis names the pipelines understand
AXIS_NAMES = ("cfg", "cp", "ulysses", "ring", "tp")


@dataclass(frozen=True)
class Family:
    """What differs between the supported pipelines."""

    pipeline: str
    #: where context parallelism starts splitting the image sequence: ``hidden_states`` dim 1 (FLUX: packed tokens
    #: go straight into a linear), or this submodule (SD3: the patch-embedding convolution takes row-sharded latents
    #: when the patch rows divide over the mesh — a patchify needs no halo; otherwise the latents enter whole and
    #: its ``[B, tokens, D]`` output is sliced, locally)
    embed_module: str | None
    #: whether the pipeline batches the classifier-free-guidance halves through one transformer call
    cfg_batch: bool
    #: transformer inputs that carry the batch dim first (sharded on ``cfg``)
    batched: tuple[str, ...]


FAMILIES = {
    "FluxPipeline": Family(
        "FluxPipeline",
        embed_module=None,
        cfg_batch=False,
        batched=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"),
    ),
    "StableDiffusion3Pipeline": Family(
        "StableDiffusion3Pipeline",
        embed_module="pos_embed",
        cfg_batch=True,
        batched=("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"),
    ),
}


@dataclass(frozen=True)
class MeshPlan:
    """The mesh a pipeline runs on, with the axis roles resolved.

    ``mesh`` is the user's mesh with every context-parallel axis named by its mode (``"ulysses"`` or ``"ring"``,
    the names the attention rule reads); ``cfg`` / ``tp`` are axis indices or ``None``; ``cp`` the CP axes."""

    mesh: DeviceMesh
    cfg: int | None
    cp: tuple[int, ...]
    tp: int | None

    @property
    def cp_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.cp)

    def size(self, axis: int | None) -> int:
        return 1 if axis is None else self.mesh.shape[axis]


def plan_mesh(mesh: DeviceMesh, config: ExecuteConfig) -> MeshPlan:
    """Check the mesh's axis names and resolve their roles (see the module docstring)."""
    names = mesh.mesh_dim_names
    if names is None:
        raise PipelineParallelError(
            f"parallelize_pipeline: the mesh {mesh} has no axis names; name every axis with one of "
            f"{list(AXIS_NAMES)} (e.g. dt.init_device_mesh('cpu', (2,), mesh_dim_names=('cp',)))"
        )
    unknown = [n for n in names if n not in AXIS_NAMES]
    if unknown:
        raise PipelineParallelError(
            f"parallelize_pipeline: mesh axes {list(unknown)} of {mesh} have no meaning for a diffusion pipeline; "
            f"axis names: 'cfg' (guidance batch), 'cp' (context parallel, ExecuteConfig.cp_mode), 'ulysses' / "
            "'ring' (cp_mode='both'), 'tp' (tensor parallel)"
        )
    cp_names = [n for n in names if n in ("cp", "ulysses", "ring")]
    mode = config.cp_mode
    if mode == "both":
        if sorted(cp_names) != ["ring", "ulysses"]:
            raise PipelineParallelError(
                f"parallelize_pipeline: cp_mode='both' needs two mesh axes named 'ulysses' and 'ring', got "
                f"{list(names)}"
            )
    elif "cp" in cp_names and len(cp_names) > 1:
        raise PipelineParallelError(
            f"parallelize_pipeline: mesh axes {list(names)} mix 'cp' with {[n for n in cp_names if n != 'cp']}; "
            "use one axis 'cp' (mode from ExecuteConfig.cp_mode) or axes 'ulysses' and 'ring' with cp_mode='both'"
        )
    elif any(n not in ("cp", mode) for n in cp_names):
        raise PipelineParallelError(
            f"parallelize_pipeline: mesh axes {list(names)} name a context-parallel mode that is not "
            f"ExecuteConfig.cp_mode={mode!r}; name the axis 'cp', or set cp_mode to match"
        )
    internal = tuple((mode if n == "cp" else n) for n in names)
    inner = DeviceMesh(mesh.device_type, mesh.mesh, mesh_dim_names=internal)
    cp = tuple(i for i, n in enumerate(internal) if n in ("ulysses", "ring"))
    return MeshPlan(
        inner,
        cfg=internal.index("cfg") if "cfg" in internal else None,
        cp=cp,
        tp=internal.index("tp") if "tp" in internal else None,
    )


def transformer_tp_plan(transformer: nn.Module) -> dict[str, Placement]:
    """Megatron-style shards of a FLUX / SD3 transformer on the ``tp`` axis, by parameter name: q/k/v projections
    (image and text streams) and the first MLP layers split their outputs (heads, hidden units), the attention
    output projections and second MLP layers their inputs. FLUX's single blocks shard their attention heads and
    ``proj_mlp``; their ``proj_out`` (over the concatenated attention and MLP features) stays replicated."""
    plan: dict[str, Placement] = {}
    cols = ("to_q.", "to_k.", "to_v.", "add_q_proj.", "add_k_proj.", "add_v_proj.")
    for name, _ in transformer.named_parameters():
        if ".attn." in name and any(c in name for c in cols):
            plan[name] = Shard(0)
        elif ".attn." in name and (name.endswith("to_out.0.weight") or name.endswith("to_add_out.weight")):
            plan[name] = Shard(1)
        elif (".ff." in name or ".ff_context." in name) and "net.0.proj." in name:
            plan[name] = Shard(0)
        elif (".ff." in name or ".ff_context." in name) and name.endswith("net.2.weight"):
            plan[name] = Shard(1)
        elif ".proj_mlp." in name:
            plan[name] = Shard(0)
    return plan


def check_heads(transformer: Any, plan: MeshPlan) -> None:
    heads = int(transformer.config.num_attention_heads)
    split = plan.cp_size * plan.size(plan.tp)
    if heads % split:
        raise PipelineParallelError(
            f"parallelize_pipeline: {type(transformer).__name__} has {heads} attention heads, which the "
            f"context-parallel x tensor-parallel degree {split} (mesh {plan.mesh.mesh_dim_names} of shape "
            f"{plan.mesh.shape}) does not divide; joint attention splits the heads over every 'cp' and 'tp' "
            f"device. Use a degree that divides {heads}"
        )
