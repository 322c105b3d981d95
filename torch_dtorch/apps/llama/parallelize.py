"""``parallelize_llama``: an unmodified Hugging Face ``LlamaForCausalLM`` (Mistral, Qwen2: same module names) laid
out on a mesh whose axis names say what is parallel.

- ``dp``: the batch (``input_ids`` ``Shard(0)``); the KV cache and logits follow.
- ``tp``: Megatron tensor parallelism with the upstream plan (:data:`LLAMA_TP_PLAN`): q/k/v and gate/up column
  parallel, o/down row parallel (each rank holds whole heads, GQA included), vocab-parallel embedding
  (``RowwiseParallel`` on ``nn.Embedding``: vocab rows sharded, partial sums all-reduced) and a vocab-sharded LM
  head whose logits are all-gathered (generation takes an arg-max / samples over the whole vocabulary).
- ``pp``: decoder layers in contiguous stages on ``mesh.unbind("pp")`` (:mod:`torch_dtorch.nn.pipeline`):
  embeddings and rotary tables on the first stage, the final norm and the LM head on the last; hidden states,
  rotary tables and masks move between stages by point-to-point copies; each layer's KV cache lives on its stage.
  The logits come back to the first stage, where ``generate`` keeps its tokens.
- ``cp``: the sequence of a prefill (``input_ids`` ``Shard(1)``); attention runs as Ulysses (all-to-all over heads),
  ring (blockwise with online softmax, causal load balanced) or both (``cp_mode``). Rotary positions are global, so
  RoPE needs no change. The KV cache the prefill writes is sequence-sharded (HF's first write,
  ``torch.cat([torch.tensor([]), keys])``, skips the empty tensor as torch does); the first decode step's
  ``torch.cat`` gathers it (decode steps, one token each, run replicated on ``cp``).

The input hook on the model puts ``input_ids`` / ``attention_mask`` / ``position_ids`` (plain torch tensors,
unbound ``t.to("dtorch")`` values, or dtorch tensors) in these placements on the first stage, so HF's own
``generate`` runs unchanged: ``model.generate(ids.to("dtorch"), max_new_tokens=N)``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torch_dtorch.api import distribute_tensor, redistribute
from torch_dtorch.apps.llama.validation import check_layout, cp_mesh
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.nn._layout import resolve_axis, set_axis_placement
from torch_dtorch.nn.parallelize import parallelize_module, replicate_module
from torch_dtorch.nn.pipeline import PipelineStages, pipeline_parallel, to_stage
from torch_dtorch.placement import Placement, Replicate, Shard

__all__ = ["LLAMA_TP_PLAN", "LlamaLayout", "llama_tp_plan", "parallelize_llama"]

log = logging.getLogger(__name__)

_R = Replicate()

#: inputs of ``LlamaForCausalLM.forward`` the hook places: (batch dim, sequence dim or None)
_INPUTS: dict[str, tuple[int, int | None]] = {
    "input_ids": (0, 1),
    "attention_mask": (0, None),  # covers past + new keys: replicated on cp
    "position_ids": (0, 1),
    "inputs_embeds": (0, 1),
}


def llama_tp_plan() -> dict[str, Any]:
    """The upstream ``torch.distributed.tensor.parallel`` plan for a ``LlamaForCausalLM`` (keys from the model's
    root), as torchtitan writes it: column-parallel in-projections, row-parallel out-projections, vocab-parallel
    embedding, vocab-sharded LM head with replicated logits."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


#: the plan :func:`parallelize_llama` applies on ``tp`` (see :func:`llama_tp_plan`)
LLAMA_TP_PLAN = llama_tp_plan()


@dataclass
class LlamaLayout:
    """Where a parallelized Llama lives: the mesh (``cp`` renamed after the mode), the stage meshes (one without
    ``pp``), and the pipeline stages (``None`` without ``pp``). Kept on the model as ``model.dtorch_layout``."""

    mesh: DeviceMesh
    cp_mode: str
    stages: list[DeviceMesh]
    pipeline: PipelineStages | None = None
    axes: dict[str, int] = field(default_factory=dict)

    @property
    def first(self) -> DeviceMesh:
        return self.stages[0]

    def input_placements(
        self, *, batch_dim: int, seq_dim: int | None, ndim: int, prefill: bool
    ) -> list[Placement]:
        """Placements on the first stage's mesh: ``Shard(batch_dim)`` on ``dp``, ``Shard(seq_dim)`` on the cp axes
        for a prefill, Replicate elsewhere."""
        out: list[Placement] = []
        for name in self.first.mesh_dim_names or ():
            if name == "dp" and batch_dim < ndim:
                out.append(Shard(batch_dim))
            elif name.startswith("cp_") and prefill and seq_dim is not None and seq_dim < ndim:
                out.append(Shard(seq_dim))
            else:
                out.append(_R)
        return out


def parallelize_llama(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    cp_mode: str = "ulysses",
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Lay out ``model`` (a ``LlamaForCausalLM``-style model: on the CPU, or on the meta device with
    ``state_dict``) on ``mesh``; returns the model, ready for ``forward`` and HF's ``generate``.

    Args:
        model: the unmodified Hugging Face model (eval mode for generation).
        mesh: a mesh with axes named from ``dp``, ``tp``, ``pp``, ``cp`` (any subset, any order).
        cp_mode: context-parallel attention on the ``cp`` axis: ``"ulysses"``, ``"ring"`` or ``"both"`` (the
            ``cp`` axis split into Ulysses x ring; needs a cp size like 4).
        state_dict: the weights by fully qualified name (may be memory-mapped: each worker's shard is read and
            uploaded alone, see :func:`torch_dtorch.apps.llama.checkpoint.load_llama`); required for a meta model.

    Raises:
        ModelLayoutError: unknown axis names, heads not divisible by ``tp``, fewer layers than ``pp`` stages,
            a model without Llama's module names, ``cp_mode="both"`` on a prime cp size.
    """
    check_layout(model, mesh, cp_mode=cp_mode)
    work = cp_mesh(mesh, cp_mode)
    names = work.mesh_dim_names or ()
    sd = _with_tied_head(model, state_dict)
    plan = llama_tp_plan() if "tp" in names and work.size("tp") > 1 else None
    pipeline: PipelineStages | None = None
    if "pp" in names:
        pipeline = pipeline_parallel(
            model,
            work,
            pp_dim="pp",
            layers="model.layers",
            last_stage=("model.norm", "lm_head"),
            plan=plan,
            tp_dim="tp" if plan else None,
            state_dict=sd,
        )
        stages = pipeline.meshes
    else:
        if plan:
            parallelize_module(model, work["tp"], plan, state_dict=sd, replicate_rest=False)
        replicate_module(model, work, state_dict=sd)
        stages = [work]
    layout = LlamaLayout(
        mesh=work,
        cp_mode=cp_mode,
        stages=stages,
        pipeline=pipeline,
        axes=dict(zip(names, work.shape, strict=True)),
    )
    model.dtorch_layout = layout  # type: ignore[assignment]
    model.register_forward_pre_hook(_input_hook(layout), with_kwargs=True)
    model.register_forward_hook(_output_hook(layout), with_kwargs=True)
    generate = getattr(model, "generate", None)
    if callable(generate):
        model.generate = _generate_on(layout, generate)  # type: ignore[assignment]
    log.info("parallelize_llama: %s on %r (cp_mode=%s)", type(model).__name__, work, cp_mode)
    return model


def _with_tied_head(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None) -> Any:
    """``state_dict`` with ``lm_head.weight`` when the model ties it to the embedding (checkpoints omit it)."""
    if state_dict is None or "lm_head.weight" in state_dict:
        return state_dict
    if getattr(model.config, "tie_word_embeddings", False) and "model.embed_tokens.weight" in state_dict:
        return _Alias(state_dict, {"lm_head.weight": "model.embed_tokens.weight"})
    return state_dict


class _Alias(Mapping[str, torch.Tensor]):
    """A read-only view of a state dict with extra names for existing entries (no tensor is read)."""

    def __init__(self, base: Mapping[str, torch.Tensor], alias: Mapping[str, str]) -> None:
        self._base = base
        self._alias = dict(alias)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._base[self._alias.get(key, key)]

    def __iter__(self) -> Any:
        yield from self._base
        yield from (k for k in self._alias if k not in self._base)

    def __len__(self) -> int:
        return len(self._base) + sum(k not in self._base for k in self._alias)

    def __contains__(self, key: object) -> bool:
        return key in self._alias or key in self._base


def _place(t: Any, layout: LlamaLayout, *, batch_dim: int, seq_dim: int | None, prefill: bool) -> Any:
    """``t`` on the first stage's mesh in the input placements (non-tensors pass through)."""
    if not isinstance(t, torch.Tensor):
        return t
    mesh = layout.first
    want = layout.input_placements(batch_dim=batch_dim, seq_dim=seq_dim, ndim=t.ndim, prefill=prefill)
    if torch.compiler.is_compiling():  # the hook traced with the model: one place request per axis
        for name, p in zip(mesh.mesh_dim_names or (), want, strict=True):
            t = set_axis_placement(
                t, resolve_axis(mesh, name, what="parallelize_llama"), p, what=f"input {name}"
            )
        return t
    if not is_dtorch(t):
        return distribute_tensor(t, mesh, want)
    op = operand_of(t)
    if op.mesh is not None and op.mesh.root != mesh.root:
        t = to_stage(t, mesh)
        op = operand_of(t)
    if op.mesh is not None and _same_layout(op.root_placements, want, mesh):
        return t
    return redistribute(t, mesh, want)


def _same_layout(have: Any, want: Any, mesh: DeviceMesh) -> bool:
    """``have`` lays a tensor out as ``want`` does: equal placements, or Shard/Replicate on an axis of size 1 (the
    one rank holds the whole tensor either way; a decode step's inputs need no redistribute on a ``dp=1`` mesh)."""
    for size, h, w in zip(mesh.shape, have, want, strict=True):
        if h != w and not (
            size == 1 and isinstance(h, (Shard, Replicate)) and isinstance(w, (Shard, Replicate))
        ):
            return False
    return True


def _input_hook(layout: LlamaLayout) -> Any:
    def hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = dict(kwargs)
        if args:  # input_ids given positionally
            kwargs.setdefault("input_ids", args[0])
            args = args[1:]
        main = kwargs.get("input_ids")
        if main is None:
            main = kwargs.get("inputs_embeds")
        prefill = isinstance(main, torch.Tensor) and main.ndim >= 2 and main.shape[1] > 1
        for name, (batch_dim, seq_dim) in _INPUTS.items():
            if kwargs.get(name) is not None:
                kwargs[name] = _place(
                    kwargs[name], layout, batch_dim=batch_dim, seq_dim=seq_dim, prefill=prefill
                )
        return args, kwargs

    return hook


def _bind_to_first_stage(layout: LlamaLayout) -> None:
    """Make the first stage the mesh that ops on mesh-less values bind to next (they bind to the mesh of the most
    recent op otherwise: the last stage's after a forward, another model's mesh before ``generate`` starts)."""
    if not torch.compiler.is_compiling():
        get_session().last_mesh = layout.first


def _output_hook(layout: LlamaLayout) -> Any:
    """Pipeline: the logits back on the first stage, where ``generate`` keeps its tokens; then the first stage is
    the mesh of the tensors ``generate`` makes for itself (``pad_token_id * (1 - unfinished)``)."""

    def hook(mod: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        logits = getattr(out, "logits", None)
        if isinstance(logits, torch.Tensor) and layout.pipeline is not None:
            out.logits = layout.pipeline.move(logits, 0)
        _bind_to_first_stage(layout)
        return out

    return hook


def _generate_on(layout: LlamaLayout, generate: Callable[..., Any]) -> Callable[..., Any]:
    """HF's own ``generate``, started with the first stage as the mesh its own tensors (positions from the
    attention mask, special-token ids, finished flags) bind to."""

    @functools.wraps(generate)
    def generate_on_mesh(*args: Any, **kwargs: Any) -> Any:
        _bind_to_first_stage(layout)
        return generate(*args, **kwargs)

    return generate_on_mesh
