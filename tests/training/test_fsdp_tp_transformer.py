"""The upstream "FSDP + TP" recipe (pytorch/examples' fsdp_tp_example.py layout) on a tiny Llama-2-style
transformer written for this test: sequence-parallel RMSNorms, column/row-parallel attention and SwiGLU, rotary
embeddings in complex form, grouped-query attention, ``fully_shard`` on dp, AdamW. 3 steps equal torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import torch_dtorch as dt
from tests.training.conftest import init_mesh
from tests.training.models import assert_params_close, twin
from torch_dtorch import Replicate, Shard


def rotary_table(head_dim: int, positions: int) -> torch.Tensor:
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(positions).float(), inv)
    return torch.polar(torch.ones_like(angles), angles)  # complex64 [positions, head_dim / 2]


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim] real; rotated as complex pairs."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * table.view(1, pairs.shape[1], 1, pairs.shape[-1])
    return torch.view_as_real(turned).flatten(3).type_as(x)


class Norm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = rotate(self.wq(x).view(b, s, self.heads, self.head_dim), table)
        k = rotate(self.wk(x).view(b, s, self.kv_heads, self.head_dim), table)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        rep = self.heads // self.kv_heads
        k = (
            k.unsqueeze(3)
            .expand(b, s, self.kv_heads, rep, self.head_dim)
            .reshape(b, s, self.heads, self.head_dim)
        )
        v = (
            v.unsqueeze(3)
            .expand(b, s, self.kv_heads, rep, self.head_dim)
            .reshape(b, s, self.heads, self.head_dim)
        )
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = Norm(dim), Norm(dim)
        self.attention = SelfAttention(dim, heads, kv_heads)
        self.feed_forward = SwiGLU(dim, 2 * dim)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama2Like(nn.Module):
    def __init__(
        self, vocab: int = 40, dim: int = 16, heads: int = 4, kv_heads: int = 2, layers: int = 2
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", rotary_table(dim // heads, 32))
        self.layers = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = Norm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        table = self.freqs_cis.to(h.device)[0 : tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, table)
        return self.output(self.norm(h)).float()


ROOT_PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
}
BLOCK_PLAN = {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
    ),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    "feed_forward.w3": ColwiseParallel(),
}


def test_fsdp_tp_sp_transformer_training() -> None:
    torch.manual_seed(0)
    ref = Llama2Like()
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    model = dt.parallelize_module(twin(ref), mesh["tp"], ROOT_PLAN)
    for block in model.layers:  # the head counts stay global: dtorch tensors have global shapes
        dt.parallelize_module(block, mesh["tp"], BLOCK_PLAN)
    model = dt.fully_shard(model, mesh=mesh["dp"])
    assert model.layers[0].attention.wq.weight.placements == (Shard(0), Shard(0))
    assert model.layers[0].ffn_norm.weight.placements == (Shard(0), Replicate())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, foreach=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(40, (4, 6), generator=gen)
        out = model(dt.distribute_tensor(tokens, mesh, [Shard(0), Replicate()]))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        want = ref(tokens)
        want.sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.testing.assert_close(out.detach().full_tensor(), want.detach(), atol=1e-5, rtol=1e-5)
    assert_params_close(model, ref)
