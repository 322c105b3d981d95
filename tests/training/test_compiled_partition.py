"""Compiled training's joint-graph partition: aot_autograd's default partitioner for every worker compiler.

Inductor's own min-cut partitioner (recompute cheap pointwise ops in the backward, where inductor fuses them) was
tried for the workers' inductor and measured worse on an H200 (the 2-layer Llama-3-8B-shaped training step: 69.8 ms
and 19.05 GiB against 68.8 ms and 17.79 GiB with the default partitioner): the forward's graph then saves the same
tensors whichever worker compiler runs it. The block's LayerNorm takes an input that needs no gradient, so its
backward is ``native_layer_norm_backward`` with a partial ``output_mask`` (propagation keeps the absent output as
``None``, as torch does). Loss and gradients equal torch."""

from __future__ import annotations

from typing import Any

import torch

import torch_dtorch as dt
from torch_dtorch.nn import replicate_module


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.up = torch.nn.Linear(32, 64)
        self.down = torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(torch.nn.functional.silu(h) * torch.sigmoid(h) * 0.5)


def _saved(worker_compiler: str, compiled_graphs: list[Any]) -> int:
    first = len(compiled_graphs)
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref, model = Block(), Block()
    model.load_state_dict(ref.state_dict())
    mesh = dt.init_device_mesh("cpu", (1,))
    replicate_module(model, mesh)
    compiled = torch.compile(model, backend="dtorch", options={"worker_compiler": worker_compiler})
    x = torch.randn(4, 8, 32)
    ref(x).square().mean().backward()
    compiled(dt.distribute_tensor(x, mesh)).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
    forward = compiled_graphs[first]
    (outputs,) = [n.args[0] for n in forward.gm.graph.nodes if n.op == "output"]
    return len(outputs) - 1  # the rest are the tensors saved for the backward


def test_every_worker_compiler_saves_what_the_default_partitioner_saves(compiled_graphs: list[Any]) -> None:
    eager = _saved("eager", compiled_graphs)
    inductor = _saved("inductor", compiled_graphs)
    assert inductor == eager, (inductor, eager)


def test_a_partial_layer_norm_backward_gives_torch_gradients(compiled_graphs: list[Any]) -> None:
    assert _saved("eager", compiled_graphs) > 0
    masks = [
        n.args[-1]
        for g in compiled_graphs
        for n in g.gm.graph.nodes
        if n.target is torch.ops.aten.native_layer_norm_backward.default
    ]
    assert masks == [[False, True, True]], masks  # no gradient for the block's input: a partial output_mask
