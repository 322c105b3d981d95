"""``parallelize_pipeline``: an unmodified diffusers ``FluxPipeline`` / ``StableDiffusion3Pipeline`` on a mesh.

What is adapted (nothing in diffusers is edited):

- The **transformer** — where the work is — moves to the mesh: its parameters become dtorch tensors (Replicate,
  or Megatron-style shards on a ``"tp"`` axis), and its class is swapped for a subclass (same name and config)
  whose ``forward`` places the call's inputs on the mesh, runs the unmodified diffusers ``forward`` (eagerly or
  through ``torch.compile(backend="dtorch")``) and returns its output as dtorch tensors. Its ``device`` reports the
  host device, so the pipeline creates the first latents where the text encoders and VAE live.
- The **denoising loop stays on the mesh** (:mod:`~torch_dtorch.apps.diffusion.loop`): the scheduler's ``step``
  runs on the dtorch output, and the latents come back to the host once, after the last step (no per-step sync).
- Inputs that do not change between steps (prompt embeddings, ids, guidance) are placed once and reused.
- **Text encoders and the VAE** run on one device (the host: the CPU, or ``cuda:0`` for CUDA meshes); they are a
  small part of the time at the resolutions that need a mesh. The VAE decode is optionally tiled
  (``vae_tiling``) and optionally on the mesh (``vae_parallel``: the decoder replicated, images and tiles sharded
  over every device; :mod:`~torch_dtorch.apps.diffusion.vae`).

Mesh axes (by name): ``"cfg"`` shards the classifier-free-guidance batch (SD3 runs the conditional and
unconditional halves in one batch); ``"cp"`` shards the joint image + text sequence (``ExecuteConfig.cp_mode``:
``"ulysses"`` or ``"ring"``; ``"both"`` on two axes ``"ulysses"`` and ``"ring"``); ``"tp"`` shards attention heads
and MLP hidden units. The attention of FLUX and SD3 is *joint*: text and image tokens, both sequence-sharded, are
concatenated along the sequence before attention; the communicating ``cat`` keeps the joint sequence sharded, so
the context-parallel attention runs the axis's mode (ring: K/V blocks rotate, each device keeps ``1/n`` of the
sequence; Ulysses: ``1/n`` of the heads). A hook returns every block's outputs to the sequence shard.
"""

from __future__ import annotations

import inspect
import logging
import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import torch_dtorch as dt
from torch_dtorch.apps.diffusion.accelerate import apply_accelerations, compiles_whole_forward
from torch_dtorch.apps.diffusion.cache import CachedBlocks
from torch_dtorch.apps.diffusion.config import ExecuteConfig
from torch_dtorch.apps.diffusion.loop import host_call, keep_loop_on_mesh
from torch_dtorch.apps.diffusion.mesh_plan import (
    FAMILIES,
    Family,
    MeshPlan,
    check_heads,
    plan_mesh,
    transformer_tp_plan,
)
from torch_dtorch.apps.diffusion.vae import decode_on_mesh
from torch_dtorch.backend import dtorch_backend
from torch_dtorch.backend.place import mesh_key, place
from torch_dtorch.device.heap import freeze_startup_heap
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import PipelineParallelError
from torch_dtorch.graph.operand import contiguous_strides
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placement, Replicate, Shard

__all__ = ["MeshPlan", "parallelize_pipeline", "plan_mesh", "transformer_tp_plan"]

log = logging.getLogger(__name__)

_R = Replicate()


def _distribute_transformer(transformer: nn.Module, plan: MeshPlan) -> None:
    """Every parameter and buffer onto the mesh: Replicate, except the TP shards on the ``tp`` axis."""
    mesh = plan.mesh
    tp_plan = transformer_tp_plan(transformer) if plan.tp is not None and plan.size(plan.tp) > 1 else {}
    for name, p in list(transformer.named_parameters()):
        placements: list[Placement] = [_R] * mesh.ndim
        if name in tp_plan:
            assert plan.tp is not None
            placements[plan.tp] = tp_plan[name]
        owner_name, _, leaf = name.rpartition(".")
        owner = transformer.get_submodule(owner_name)
        owner.register_parameter(
            leaf, nn.Parameter(dt.distribute_tensor(p.detach(), mesh, placements), False)
        )
    for name, b in list(transformer.named_buffers()):
        owner_name, _, leaf = name.rpartition(".")
        owner = transformer.get_submodule(owner_name)
        persistent = leaf not in getattr(owner, "_non_persistent_buffers_set", set())
        owner.register_buffer(leaf, dt.distribute_tensor(b, mesh, [_R] * mesh.ndim), persistent=persistent)


@dataclass
class _Runner:
    """Per-transformer state of the mesh forward: the plan, the host device, cached placed inputs."""

    family: Family
    plan: MeshPlan
    host: torch.device
    base_forward: Callable[..., Any]
    patch_size: int = 1
    compiled: Callable[..., Any] | None = None
    #: called before every transformer call: (re)wraps the pipeline's loop (a scheduler swapped in after
    #: ``parallelize_pipeline`` is wrapped at its first step)
    before_call: Callable[[], None] | None = None
    #: input name -> (the host tensor it came from, its version, the placed tensor)
    cache: dict[str, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = field(default_factory=dict)

    def placements(self, name: str, x: torch.Tensor) -> list[Placement]:
        plan, fam = self.plan, self.family
        pl: list[Placement] = [_R] * plan.mesh.ndim
        if plan.cfg is not None and name in fam.batched and x.ndim >= 1:
            n = plan.size(plan.cfg)
            if x.shape[0] % n:
                raise PipelineParallelError(
                    f"{fam.pipeline}: the transformer's {name} {list(x.shape)} has batch {x.shape[0]}, which the "
                    f"'cfg' axis of size {n} does not divide; the cfg axis splits the guidance batch (SD3 with "
                    "guidance_scale > 1 doubles it): use guidance, or drop the cfg axis"
                )
            pl[plan.cfg] = Shard(0)
        if plan.cp and name == "hidden_states":
            n = plan.cp_size
            p = self.patch_size
            tokens = x.shape[1] if fam.embed_module is None else (x.shape[-2] // p) * (x.shape[-1] // p)
            if tokens % n:
                raise PipelineParallelError(
                    f"{fam.pipeline}: the transformer's hidden_states {list(x.shape)} make {tokens} image tokens, "
                    f"which the context-parallel degree {n} does not divide; choose a height/width whose image "
                    f"sequence splits in {n}"
                )
            if fam.embed_module is None:
                for a in plan.cp:
                    pl[a] = Shard(1)
            elif self.rows_split(x):
                for a in plan.cp:
                    pl[a] = Shard(x.ndim - 2)  # the latent rows: the patchify convolution keeps them sharded
        if plan.cp and name == "encoder_hidden_states":
            for a in (
                plan.cp
            ):  # text tokens too (uneven shards are exact): the joint cat keeps the sequence sharded
                pl[a] = Shard(1)
        return pl

    def rows_split(self, x: torch.Tensor) -> bool:
        """Whether SD3's latents ``[B, C, H, W]`` enter the transformer row-sharded on the CP axes: the patch
        embedding (a convolution with kernel == stride == patch size) then runs on each device's rows without a
        gather (``placement_rules/families/spatial.py``, the halo-free signature) when the patch rows divide evenly
        over the whole mesh; otherwise the latents stay whole and the embedding's output is sliced."""
        return (x.shape[-2] // self.patch_size) % math.prod(self.plan.mesh.shape) == 0 and (
            x.shape[-2] % self.patch_size == 0
        )

    def place(self, name: str, x: Any) -> Any:
        """``x`` on the mesh with the placements of input ``name``: a host tensor is distributed (once while it is
        the same tensor at the same version), a dtorch tensor from an earlier step redistributed if needed (so a
        compiled transformer always sees the same layout)."""
        if not isinstance(x, torch.Tensor):
            return x
        if is_dtorch(x):
            want = self.placements(name, x)
            cur = list(x.placements)  # type: ignore[attr-defined]
            return x if cur == want else x.redistribute(self.plan.mesh, want)  # type: ignore[attr-defined]
        hit = self.cache.get(name)
        if hit is not None and hit[0]() is x and hit[1] == x._version:
            return hit[2]
        dense = x
        if x.stride() != contiguous_strides(x.shape):  # e.g. an expanded timestep: the wire wants dense bytes
            dense = x.clone(memory_format=torch.contiguous_format)
        placed = dt.distribute_tensor(dense, self.plan.mesh, self.placements(name, x))
        self.cache[name] = (weakref.ref(x), x._version, placed)
        return placed

    def placed_copy(self, x: torch.Tensor) -> torch.Tensor | None:
        """The dtorch copy this runner placed of the host tensor ``x`` (same tensor, same version), or ``None``."""
        for ref, version, placed in self.cache.values():
            if ref() is x and x._version == version:
                return placed
        return None


def _shard_sequence_after(module: nn.Module, plan: MeshPlan) -> None:
    """Slice ``module``'s ``[B, tokens, D]`` output along the tokens on every CP axis (a local slice of a
    replicated tensor; ``dtorch::place`` so that it also holds inside ``torch.compile``)."""
    key = mesh_key(plan.mesh)

    def hook(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        for a in plan.cp:
            out = place(out, key, a, "S(1)", what=f"{type(mod).__name__} output (context parallel)")
        return out

    module.register_forward_hook(hook)


#: the transformer's block lists whose outputs go back to the sequence shard (FLUX: both; SD3: the first)
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks")


def _keep_sequence_sharded(transformer: nn.Module, plan: MeshPlan) -> None:
    """Every block's ``[B, tokens, D]`` outputs back on the sequence shard of every CP axis.

    Inside a block, the attention output is split into its text and image parts along the sharded sequence; the
    planner moves that shard to another dim first — the batch when it divides the axis — and the rest of the block
    follows. Without this hook the next block would start batch-sharded and its attention would split the batch
    instead of ringing; with it every block's joint attention sees the sequence sharded (a no-op at batch 1)."""
    key = mesh_key(plan.mesh)

    def seq(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.ndim < 2 or not is_dtorch(t):
            return t
        if torch.compiler.is_compiling():
            for a in plan.cp:
                t = place(t, key, a, "S(1)", what="transformer block output (context parallel)")
            return t
        cur = list(t.placements)  # type: ignore[attr-defined]
        want = [Shard(1) if a in plan.cp else p for a, p in enumerate(cur)]
        return t if want == cur else t.redistribute(plan.mesh, want)  # type: ignore[attr-defined]

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        return tuple(seq(t) for t in out) if isinstance(out, tuple) else seq(out)

    for name in _BLOCK_LISTS:
        for block in getattr(transformer, name, None) or ():
            # a step cache holds every block itself (CachedBlocks): hook the blocks inside it
            for inner in block.blocks if isinstance(block, CachedBlocks) else (block,):
                inner.register_forward_hook(hook)


def _mesh_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    runner: _Runner = self._dtorch_runner  # type: ignore[assignment]
    if args:
        bound = inspect.signature(runner.base_forward).bind_partial(*args, **kwargs)
        kwargs = dict(bound.arguments)
    placed = {k: runner.place(k, v) for k, v in kwargs.items()}
    if runner.before_call is not None:
        runner.before_call()
    fn = runner.compiled if runner.compiled is not None else runner.base_forward
    with torch.no_grad():
        return fn(**placed)  # dtorch tensors: the denoising loop stays on the mesh (loop.py)


def _host_device(self: Any) -> torch.device:
    runner: _Runner = self._dtorch_runner
    return runner.host


def _refuse_move(self: Any, *args: Any, **kwargs: Any) -> Any:
    raise PipelineParallelError(
        f"{type(self).__name__}.to/cuda/cpu(...) after parallelize_pipeline: the transformer's weights live on the "
        "mesh's workers and cannot be moved. Load and move the pipeline first (from_pretrained(torch_dtype=...), "
        "pipe.to(...)), then call parallelize_pipeline"
    )


_MESH_CLASSES: dict[type, type] = {}


def _mesh_class(cls: type) -> type:
    """``cls`` with the mesh forward and the host ``device`` (same name, module and config)."""
    if cls not in _MESH_CLASSES:
        _MESH_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": _mesh_forward,
                "device": property(_host_device),
                "to": _refuse_move,
                "cuda": _refuse_move,
                "cpu": _refuse_move,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": f"{cls.__name__} on a dtorch mesh (torch_dtorch.apps.diffusion).",
            },
        )
    return _MESH_CLASSES[cls]


_HOST_PIPELINES: dict[type, type] = {}


def _host_pipeline_class(cls: type) -> type:
    """The pipeline class ``cls`` whose ``__call__`` returns plain tensors (same name, module and config)."""
    if cls not in _HOST_PIPELINES:
        _HOST_PIPELINES[cls] = type(
            cls.__name__,
            (cls,),
            {"__call__": host_call(cls), "__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return _HOST_PIPELINES[cls]


def _host_of(mesh: DeviceMesh) -> torch.device:
    return torch.device("cuda", 0) if mesh.device_type == "cuda" else torch.device("cpu")


def _family_of(pipe: Any) -> Family:
    for cls in type(pipe).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    raise PipelineParallelError(
        f"parallelize_pipeline: {type(pipe).__name__} is not supported; supported pipelines: "
        f"{sorted(FAMILIES)} (diffusers). Other pipelines: parallelize their transformer with "
        "torch_dtorch.nn.parallelize_module"
    )


def parallelize_pipeline(pipe: Any, mesh: DeviceMesh, config: ExecuteConfig | None = None) -> Any:
    """Run ``pipe`` (a diffusers ``FluxPipeline`` or ``StableDiffusion3Pipeline``) on ``mesh``; in place, returns
    ``pipe``. The mesh's axis names say what is parallel (``cfg``, ``cp`` / ``ulysses`` / ``ring``, ``tp``: see the
    module docstring). Call the pipeline exactly as in diffusers afterwards; it returns plain images.

    Raises :class:`~torch_dtorch.errors.PipelineParallelError` for an unsupported pipeline, mesh axis names the
    pipeline cannot use, or parallel degrees that do not divide the attention heads (the sequence is checked at
    the first call, when the image size is known)."""
    config = config or ExecuteConfig()
    family = _family_of(pipe)
    plan = plan_mesh(mesh, config)
    if plan.cfg is not None and plan.size(plan.cfg) > 1 and not family.cfg_batch:
        raise PipelineParallelError(
            f"parallelize_pipeline: {family.pipeline} has no classifier-free-guidance batch (FLUX embeds the "
            f"guidance scale), so the 'cfg' axis of size {plan.size(plan.cfg)} has nothing to split; use it as "
            "'cp' or 'tp'"
        )
    transformer = pipe.transformer
    if hasattr(transformer, "_dtorch_runner"):
        raise PipelineParallelError("parallelize_pipeline: this pipeline's transformer is already on a mesh")
    check_heads(transformer, plan)
    host = _host_of(mesh)
    for name, component in pipe.components.items():
        if isinstance(component, nn.Module) and name != "transformer":
            component.to(host)
    if config.vae_tiling and getattr(pipe, "vae", None) is not None:
        pipe.vae.enable_tiling()
    if config.vae_parallel and getattr(pipe, "vae", None) is not None:
        decode_on_mesh(pipe.vae, plan.mesh)
    transformer.eval()
    apply_accelerations(pipe, transformer, plan.mesh, config)  # quantization, fused ops, step cache
    _distribute_transformer(transformer, plan)
    base = type(transformer)
    runner = _Runner(
        family,
        plan,
        host,
        base_forward=base.forward.__get__(transformer),  # type: ignore[attr-defined]
        patch_size=int(getattr(transformer.config, "patch_size", 1)),
    )
    if compiles_whole_forward(config):  # a step cache compiles its blocks itself
        options = config.compile_options(mesh.device_type)
        runner.compiled = torch.compile(runner.base_forward, backend=dtorch_backend, options=options)
    if family.embed_module is not None and plan.cp:
        _shard_sequence_after(transformer.get_submodule(family.embed_module), plan)
    if plan.cp:
        _keep_sequence_sharded(transformer, plan)
    transformer._dtorch_runner = runner
    transformer.__class__ = _mesh_class(base)
    pipe_ref = weakref.ref(pipe)

    def keep_loop() -> None:
        if (p := pipe_ref()) is not None:
            keep_loop_on_mesh(p, plan.mesh, runner.placed_copy)

    runner.before_call = keep_loop
    keep_loop()
    pipe.__class__ = _host_pipeline_class(type(pipe))
    log.info(
        "parallelize_pipeline: %s on mesh %s (axes %s), compile=%s",
        family.pipeline,
        tuple(mesh.shape),
        plan.mesh.mesh_dim_names,
        config.compile,
    )
    freeze_startup_heap("parallelize_pipeline")
    return pipe


def describe(pipe: Any) -> Mapping[str, Any]:
    """The mesh plan of a parallelized pipeline (for logs and the CLI)."""
    runner: _Runner = pipe.transformer._dtorch_runner
    return {
        "pipeline": runner.family.pipeline,
        "mesh": dict(zip(runner.plan.mesh.mesh_dim_names or (), runner.plan.mesh.shape, strict=True)),
        "compiled": runner.compiled is not None,
    }
