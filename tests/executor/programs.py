"""Op sequences shared by the executor tests. ``g`` is a GraphConstructor or an EagerGraphExecutor (same API)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Replicate, Shard

aten = torch.ops.aten
R = Replicate()


class Feeding:
    """Wraps an executor so that every ``input(..., tag=name)`` is uploaded at once with ``values[name]``."""

    def __init__(self, ex: Any, values: dict[str, torch.Tensor]) -> None:
        self.ex = ex
        self.values = values

    def input(self, shape: Any, mesh: DeviceMesh, placements: Any = None, *, tag: str, **kw: Any) -> Operand:
        o = self.ex.input(shape, mesh, placements, tag=tag, **kw)
        self.ex.upload(o, self.values[tag])
        return o

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ex, name)


def mlp(g: Any, mesh: DeviceMesh, *, hidden: int = 10) -> tuple[dict[str, Operand], list[Operand]]:
    """Column-parallel then row-parallel MLP on the last mesh axis (the first axis shards the batch, if any)."""
    dp = [Shard(0)] if mesh.ndim == 2 else []
    pre = [R] * (mesh.ndim - 1)
    ins = {
        "x": g.input((7, 8), mesh, [*dp, R] if dp else [R], tag="x"),
        "w1": g.input((8, hidden), mesh, [*pre, Shard(1)], tag="w1"),
        "b1": g.input((hidden,), mesh, [*pre, Shard(0)], tag="b1"),
        "w2": g.input((hidden, 8), mesh, [*pre, Shard(0)], tag="w2"),
    }
    h = g.call(
        aten.relu.default, g.call(aten.add.Tensor, g.call(aten.mm.default, ins["x"], ins["w1"]), ins["b1"])
    )
    y = g.call(aten.mm.default, h, ins["w2"])  # partial sum over the last axis
    out = g.redistribute(y, [*dp, R] if dp else [R])
    z = g.call(aten.mul.Tensor, g.call(aten.tanh.default, out), ins["x"])
    return ins, [y, out, z]


def mlp_torch(v: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    y = torch.relu(v["x"] @ v["w1"] + v["b1"]) @ v["w2"]
    return [y, y, torch.tanh(y) * v["x"]]


def attention(
    g: Any, mesh: DeviceMesh, *, batch: int = 2, seq: int = 5, hd: int = 2
) -> tuple[dict[str, Operand], list[Operand]]:
    """Tensor-parallel attention + residual on a 1-d mesh: heads split over the devices."""
    n = mesh.size()
    heads = 2 * n
    dim = heads * hd
    ins = {
        "x": g.input((batch, seq, dim), mesh, [R], tag="x"),
        "wq": g.input((dim, dim), mesh, [Shard(0)], tag="wq"),
        "wk": g.input((dim, dim), mesh, [Shard(0)], tag="wk"),
        "wv": g.input((dim, dim), mesh, [Shard(0)], tag="wv"),
        "wo": g.input((dim, dim), mesh, [Shard(1)], tag="wo"),
    }
    x = ins["x"]

    def split_heads(t: Operand) -> Operand:
        return g.call(aten.transpose.int, g.call(aten.view.default, t, [batch, seq, heads, hd]), 1, 2)

    q, k, v = (split_heads(g.call(aten.linear.default, x, ins[w])) for w in ("wq", "wk", "wv"))
    a = g.call(aten.scaled_dot_product_attention.default, q, k, v, is_causal=True)
    a = g.call(aten.reshape.default, g.call(aten.transpose.int, a, 1, 2), [batch, seq, dim])
    o = g.redistribute(g.call(aten.linear.default, a, ins["wo"]), [R])
    y = g.call(aten.add.Tensor, x, o)
    s = g.call(aten.softmax.int, y, -1)
    return ins, [a, y, s]


def attention_torch(
    v: dict[str, torch.Tensor], *, batch: int = 2, seq: int = 5, hd: int = 2
) -> list[torch.Tensor]:
    x = v["x"]
    dim = x.shape[-1]
    heads = dim // hd

    def split_heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, seq, heads, hd).transpose(1, 2)

    q, k, vv = (split_heads(F.linear(x, v[w])) for w in ("wq", "wk", "wv"))
    a = F.scaled_dot_product_attention(q, k, vv, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
    y = x + F.linear(a, v["wo"])
    return [a, y, torch.softmax(y, -1)]
