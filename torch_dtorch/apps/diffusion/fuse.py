"""Fused operators in the diffusion transformer (``ExecuteConfig(fuse=FuseConfig(...))``).

Modules of the unmodified diffusers transformer are switched (per instance: their class becomes a subclass with the
same name and a fused ``forward``) to call the registered fused ops of
``torch_dtorch/placement_rules/families/fused.py`` — each with its own placement rule, and a kernel compiled per
worker on CUDA (the plain torch reference on the CPU, so results are bit-identical there):

- **adaLN** (``AdaLayerNormZero``, ``AdaLayerNormZeroSingle``, ``AdaLayerNormContinuous`` with a plain
  ``LayerNorm`` without affine): the modulation projection ``linear(silu(temb))`` becomes ``silu_linear``
  (``FuseConfig.silu_linear``; its output is chunked into shift / scale / gate as before) and
  ``norm(x) * (1 + scale) + shift`` becomes ``modulate`` (``FuseConfig.modulate``);
- **MLP** (diffusers' ``GELU`` activation module, the first layer of every ``FeedForward``): ``gelu(proj(x))``
  becomes ``linear_gelu`` (``FuseConfig.linear_gelu``);
- **rotary embedding** (FLUX): the attention processor applies ``rotary`` to q and k
  (``FuseConfig.rotary``).

Linears already quantized (``QuantizeConfig``) keep their quantized op; the ops around them are still fused.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from torch_dtorch.apps.diffusion.config import FuseConfig
from torch_dtorch.placement_rules.families.fused import LINEAR_GELU, MODULATE, ROTARY, SILU_LINEAR

__all__ = ["fuse_transformer"]

log = logging.getLogger(__name__)

_ADALN = ("AdaLayerNormZero", "AdaLayerNormZeroSingle", "AdaLayerNormContinuous")


def _config(module: nn.Module) -> FuseConfig:
    config: FuseConfig = module._dtorch_fuse  # type: ignore[assignment]
    return config


def _project(module: Any, emb: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``module.linear(module.silu(emb))`` (``.to(dtype)`` after the silu when given), fused when possible."""
    if _config(module).silu_linear and type(module.linear) is nn.Linear and dtype in (None, emb.dtype):
        return SILU_LINEAR(emb, module.linear.weight, module.linear.bias)  # type: ignore[no-any-return]
    act = module.silu(emb)
    return module.linear(act if dtype is None else act.to(dtype))  # type: ignore[no-any-return]


def _plain_layer_norm(norm: nn.Module) -> bool:
    return type(norm) is nn.LayerNorm and norm.weight is None and norm.bias is None


def _modulate(module: Any, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``module.norm(x) * (1 + scale[:, None]) + shift[:, None]``, fused when possible."""
    if _config(module).modulate and _plain_layer_norm(module.norm):
        return MODULATE(x, shift, scale, module.norm.eps)  # type: ignore[no-any-return]
    return module.norm(x) * (1 + scale[:, None]) + shift[:, None]  # type: ignore[no-any-return]


def _ada_zero_forward(
    self: Any,
    x: torch.Tensor,
    timestep: torch.Tensor | None = None,
    class_labels: torch.LongTensor | None = None,
    hidden_dtype: torch.dtype | None = None,
    emb: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    if self.emb is not None:
        emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
    assert emb is not None
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _project(self, emb).chunk(6, dim=1)
    return _modulate(self, x, shift_msa, scale_msa), gate_msa, shift_mlp, scale_mlp, gate_mlp


def _ada_zero_single_forward(
    self: Any, x: torch.Tensor, emb: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    shift_msa, scale_msa, gate_msa = _project(self, emb).chunk(3, dim=1)
    return _modulate(self, x, shift_msa, scale_msa), gate_msa


def _ada_continuous_forward(self: Any, x: torch.Tensor, conditioning_embedding: torch.Tensor) -> torch.Tensor:
    scale, shift = torch.chunk(_project(self, conditioning_embedding, x.dtype), 2, dim=1)
    return _modulate(self, x, shift, scale)


def _gelu_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    if type(self.proj) is nn.Linear:
        return LINEAR_GELU(hidden_states, self.proj.weight, self.proj.bias, self.approximate)  # type: ignore[no-any-return]
    return self.gelu(self.proj(hidden_states))  # type: ignore[no-any-return]


_FORWARDS = {
    "AdaLayerNormZero": _ada_zero_forward,
    "AdaLayerNormZeroSingle": _ada_zero_single_forward,
    "AdaLayerNormContinuous": _ada_continuous_forward,
    "GELU": _gelu_forward,
}
_FUSED_CLASSES: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    if cls not in _FUSED_CLASSES:
        _FUSED_CLASSES[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": _FORWARDS[cls.__name__],
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": f"{cls.__name__} with fused operators (torch_dtorch.apps.diffusion.fuse).",
            },
        )
    return _FUSED_CLASSES[cls]


def _flux_processor_class() -> type | None:
    """diffusers' ``FluxAttnProcessor`` with the rotary embedding as one op (``None`` if this diffusers lacks the
    helpers the processor is built from)."""
    from diffusers.models.transformers import transformer_flux as tf

    if not all(
        hasattr(tf, n) for n in ("FluxAttnProcessor", "_get_qkv_projections", "dispatch_attention_fn")
    ):
        return None

    class FusedFluxAttnProcessor(tf.FluxAttnProcessor):  # type: ignore[misc, name-defined]
        """``FluxAttnProcessor`` whose rotary embedding of q and k is ``dtorch_fused::rotary``."""

        def __call__(  # type: ignore[override]
            self,
            attn: Any,
            hidden_states: torch.Tensor,
            encoder_hidden_states: torch.Tensor | None = None,
            attention_mask: torch.Tensor | None = None,
            image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        ) -> Any:
            query, key, value, encoder_query, encoder_key, encoder_value = tf._get_qkv_projections(
                attn, hidden_states, encoder_hidden_states
            )
            query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
            key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
            value = value.unflatten(-1, (-1, attn.head_dim))
            if attn.added_kv_proj_dim is not None:
                encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
                encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
                encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
                query = torch.cat([encoder_query, query], dim=1)
                key = torch.cat([encoder_key, key], dim=1)
                value = torch.cat([encoder_value, value], dim=1)
            if image_rotary_emb is not None:
                cos, sin = image_rotary_emb
                query = ROTARY(query, cos, sin, 1)
                key = ROTARY(key, cos, sin, 1)
            hidden_states = tf.dispatch_attention_fn(
                query,
                key,
                value,
                attn_mask=attention_mask,
                backend=self._attention_backend,
                parallel_config=self._parallel_config,
            )
            hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
            if encoder_hidden_states is None:
                return hidden_states
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [encoder_hidden_states.shape[1], hidden_states.shape[1] - encoder_hidden_states.shape[1]],
                dim=1,
            )
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
            return hidden_states, encoder_hidden_states

    return FusedFluxAttnProcessor


def fuse_transformer(transformer: nn.Module, config: FuseConfig) -> dict[str, int]:
    """Switch ``transformer``'s modules to their fused forms (in place); returns how many of each kind."""
    counts: Counter[str] = Counter()
    processor_cls: type | None = None
    for _, module in transformer.named_modules():
        name = type(module).__name__
        if name in _ADALN and (config.modulate or config.silu_linear) and name in _FORWARDS:
            if type(module).__module__.startswith("diffusers.") and hasattr(module, "linear"):
                module._dtorch_fuse = config
                module.__class__ = _fused_class(type(module))
                counts["adaln"] += 1
        elif name == "GELU" and config.linear_gelu and type(module).__module__.startswith("diffusers."):
            module.__class__ = _fused_class(type(module))
            counts["linear_gelu"] += 1
        elif name == "FluxAttention" and config.rotary:
            if type(module.processor).__name__ != "FluxAttnProcessor":
                continue  # IP-adapter and other processors stay as they are
            processor_cls = processor_cls or _flux_processor_class()
            if processor_cls is None:
                log.warning(
                    "fuse: this diffusers has no FluxAttnProcessor helpers; rotary embedding not fused"
                )
                continue
            module.set_processor(processor_cls())
            counts["rotary"] += 1
    log.info("fused operators: %s", dict(counts))
    return dict(counts)
