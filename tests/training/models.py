"""Tiny models shared by the training tests, and helpers comparing dtorch gradients with torch's."""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

import torch_dtorch as dt


class MLP(nn.Module):
    """Linear -> GELU -> LayerNorm -> Linear (the TP MLP of the examples, with a norm)."""

    def __init__(self, dim: int = 6, hidden: int = 10, out: int = 5) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.out_proj = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.norm(F.gelu(self.in_proj(x))))


class TinyLM(nn.Module):
    """Embedding -> RMSNorm -> ReLU MLP -> head: every backward family of a language model."""

    def __init__(self, vocab: int = 11, dim: int = 6, hidden: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(h)


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def assert_grads_close(
    got: Iterable[tuple[str, torch.Tensor]], want: Iterable[tuple[str, torch.Tensor]], *, atol: float = 1e-5
) -> None:
    """Same parameter names, every dtorch gradient equal to torch's and in its parameter's placements."""
    got, want = dict(got), dict(want)
    assert got.keys() == want.keys()
    for name, p in got.items():
        q = want[name]
        assert p.grad is not None, f"{name}: no gradient"
        assert q.grad is not None
        assert p.grad.placements == p.placements, f"{name}: grad {p.grad.placements} vs param {p.placements}"
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=atol, rtol=1e-5, msg=name)


def assert_params_close(model: nn.Module, ref: nn.Module, *, atol: float = 1e-5) -> None:
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), atol=atol, rtol=1e-5, msg=name)


def dist(t: torch.Tensor, mesh: dt.DeviceMesh, placements: list, *, grad: bool = False) -> torch.Tensor:
    out = dt.distribute_tensor(t, mesh, placements)
    return out.requires_grad_() if grad else out
