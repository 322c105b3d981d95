"""Tiny models and helpers shared by the compile-backend tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.down(F.silu(self.up(x))))


class Attention(nn.Module):
    """Pre-norm self-attention block: qkv projections, SDPA, output projection, residual."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm(x)

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        return x + self.o(a.transpose(1, 2).reshape(b, s, d))


def distribute_module(
    model: nn.Module, mesh: dt.DeviceMesh, plan: dict[str, Sequence[Any]] | None = None
) -> nn.Module:
    """Move every parameter onto ``mesh`` (Replicate unless ``plan`` names its placements)."""
    plan = plan or {}
    for name, p in list(model.named_parameters()):
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        leaf = name.rsplit(".", 1)[-1]
        placements = plan.get(name, [Replicate()] * mesh.ndim)
        setattr(
            owner, leaf, nn.Parameter(dt.distribute_tensor(p.detach(), mesh, placements), requires_grad=False)
        )
    for name, b in list(model.named_buffers()):
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        owner.register_buffer(
            name.rsplit(".", 1)[-1], dt.distribute_tensor(b, mesh, [Replicate()] * mesh.ndim)
        )
    return model


def tp_mlp_plan() -> dict[str, Sequence[Any]]:
    return {"up.weight": [Shard(0)], "up.bias": [Shard(0)], "down.weight": [Shard(1)]}


class HookCounter:
    """Counts the instructions workers run, by type name (via the kernel hooks)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __call__(self, instr: Any, device: int) -> None:
        name = type(instr).__name__
        self.counts[name] = self.counts.get(name, 0) + 1


def with_hook(hook: Callable[[Any, int], None], fn: Callable[[], Any]) -> Any:
    from torch_dtorch.runtime import op_runner as kernel

    kernel.after_hooks.append(hook)
    try:
        out = fn()
        dt.sync()
        return out
    finally:
        kernel.after_hooks.remove(hook)


def tiny_flux() -> tuple[nn.Module, dict[str, Any]]:
    """A tiny random diffusers ``FluxTransformer2DModel`` (1 double + 1 single block) and its inputs (offline)."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=False,
        axes_dims_rope=(2, 2, 4),
    ).eval()  # fmt: skip
    b, s, t = 2, 8, 4
    inputs = {
        "hidden_states": torch.randn(b, s, 4),
        "encoder_hidden_states": torch.randn(b, t, 16),
        "pooled_projections": torch.randn(b, 8),
        "timestep": torch.tensor([0.5, 0.25]),
        "img_ids": torch.randn(s, 3),
        "txt_ids": torch.randn(t, 3),
    }
    return model, inputs


def tiny_sd3() -> tuple[nn.Module, dict[str, Any]]:
    """A tiny random diffusers ``SD3Transformer2DModel`` (1 block, 8x8 latents) and its inputs (offline)."""
    import diffusers

    torch.manual_seed(0)
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8, out_channels=4,
        pos_embed_max_size=8,
    ).eval()  # fmt: skip
    inputs = {
        "hidden_states": torch.randn(2, 4, 8, 8),
        "encoder_hidden_states": torch.randn(2, 4, 16),
        "pooled_projections": torch.randn(2, 8),
        "timestep": torch.tensor([0.5, 0.25]),
    }
    return model, inputs


#: the tiny diffusers transformers, and the dim of ``hidden_states`` that sequence sharding splits (flux: tokens;
#: sd3: image rows)
TINY_TRANSFORMERS = {"flux": tiny_flux, "sd3": tiny_sd3}
SEQ_DIM = {"flux": 1, "sd3": 2}


def transformer_tp_plan(model: nn.Module) -> dict[str, Sequence[Any]]:
    """Megatron-style TP over attention heads and MLP hidden units of every diffusers transformer block."""
    plan: dict[str, Sequence[Any]] = {}
    for name, _ in model.named_parameters():
        if ".attn." in name and any(
            p in name for p in ("to_q.", "to_k.", "to_v.", "add_q_proj.", "add_k_proj.", "add_v_proj.")
        ):
            plan[name] = [Shard(0)]
        elif ".attn." in name and any(p in name for p in ("to_out.0.weight", "to_add_out.weight")):
            plan[name] = [Shard(1)]
        elif ".ff" in name and "net.0.proj." in name:
            plan[name] = [Shard(0)]
        elif ".ff" in name and "net.2.weight" in name:
            plan[name] = [Shard(1)]
    return plan
