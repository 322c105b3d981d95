"""A compact Llama-2 transformer for the FSDP + TP example: RMSNorm, rotary embeddings in complex form,
grouped-query attention, a SwiGLU feed-forward. Plain PyTorch: nothing here knows about dtorch (the model code of
a tensor-parallel program stays global; see README.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 16
    n_kv_heads: int | None = None
    vocab_size: int = 32000
    multiple_of: int = 256  # the SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 32768  # the rotary table covers twice this


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_frequencies(head_dim: int, positions: int, theta: float = 10000.0) -> torch.Tensor:
    """``[positions, head_dim // 2]`` unit complex numbers ``exp(i * position * theta^(-2k / head_dim))``."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` and ``k`` (``[batch, seq, heads, head_dim]``) as complex pairs by ``freqs`` (``[seq, head_dim/2]``)."""

    def turn(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        table = freqs.view(1, pairs.shape[1], 1, pairs.shape[-1])
        return torch.view_as_real(pairs * table).flatten(3).type_as(x)

    return turn(q), turn(k)


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """``[b, s, kv_heads, d]`` -> ``[b, s, kv_heads * times, d]`` (each kv head serves ``times`` query heads)."""
    if times == 1:
        return x
    b, s, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, times, d).reshape(b, s, kv * times, d)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads or args.n_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, freqs)
        rep = self.n_heads // self.n_kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=std)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = int(2 * (4 * args.dim) / 3)
        if args.ffn_dim_multiplier is not None:
            hidden = int(args.ffn_dim_multiplier * hidden)
        hidden = args.multiple_of * ((hidden + args.multiple_of - 1) // args.multiple_of)
        self.w1 = nn.Linear(args.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, args.dim, bias=False)
        self.w3 = nn.Linear(args.dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for lin in (self.w2, self.w3):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.std)
        self.feed_forward.init_weights(self.std)


class Transformer(nn.Module):
    freqs_cis: torch.Tensor

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.register_buffer("freqs_cis", rotary_frequencies(args.dim // args.n_heads, args.max_seq_len * 2))
        self.layers = nn.ModuleList(TransformerBlock(i, args) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.init_weights()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        # the buffer follows the activations' device on first use (a dtorch tensor from then on), as upstream's
        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs)
        return self.output(self.norm(h)).float()

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()  # type: ignore[operator]
        self.norm.reset_parameters()
        bound = 3 * self.args.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.args.dim**-0.5, a=-bound, b=bound)

    @classmethod
    def from_model_args(cls, args: ModelArgs) -> Transformer:
        return cls(args)
