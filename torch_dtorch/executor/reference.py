"""Reference executor: runs a LogicalGraph in ONE process on plain torch shards (a dict of mesh coordinate ->
local tensor per operand), with the rules' local kernels and the planner's steps simulated collective by
collective. It is the semantic yardstick the worker runtime is tested against, and what the demo uses before
workers exist. Not fast: every rank runs in turn.
"""

from __future__ import annotations

import torch

from torch_dtorch.executor.constructor import BoundOp
from torch_dtorch.graph import LogicalGraph, Operand
from torch_dtorch.placement_rules.families.context_parallel import kernel_needs_comm
from torch_dtorch.placement_rules.ranks import Shards, assemble, distribute, run_all_ranks, run_rank
from torch_dtorch.placement_rules.redistribute.simulate import apply_plan

__all__ = ["ReferenceExecutor"]


class ReferenceExecutor:
    """Holds the shards of every operand computed so far."""

    def __init__(self, graph: LogicalGraph, *, seed: int = 0) -> None:
        self.graph = graph
        self.shards: dict[int, Shards] = {}
        self._gen = torch.Generator().manual_seed(seed)

    def feed(self, operand: Operand, value: torch.Tensor) -> None:
        """Give an input operand its global value (split per its placements; Partial splits are random)."""
        assert operand.mesh is not None, "unbound inputs are not supported by the reference executor"
        root = operand.mesh.root
        self.shards[operand.id] = distribute(value, root.shape, operand.root_placements, gen=self._gen)

    def run(self) -> None:
        for node in self.graph.operators:
            if any(o.id in self.shards for o in node.outputs):
                continue
            if node.op == "redistribute":
                src = node.inputs[0]
                assert src is not None
                self.shards[node.outputs[0].id] = apply_plan(node.payload, self.shards[src.id], src.shape)
                continue
            bound: BoundOp = node.payload
            rule, call = bound.rule, bound.call
            mesh = node.outputs[0].mesh
            assert mesh is not None
            root = mesh.root
            out_pl = [o.root_placements for o in node.outputs]
            if kernel_needs_comm(call):
                # a kernel that talks to its peers (norms over a sharded dim, context-parallel attention): every
                # rank on its own thread with a simulated communicator
                local = {
                    coord: [self.shards[x.id][coord] if x is not None else None for x in node.inputs]
                    for _, coord in root.coordinates()
                }
                per_rank = run_all_ranks(rule, call, out_pl, local, root.shape)
                for k, o in enumerate(node.outputs):
                    self.shards[o.id] = {c: v[k] for c, v in per_rank.items()}
                continue
            per_rank = {
                coord: run_rank(
                    rule,
                    call,
                    coord,
                    root.shape,
                    [self.shards[x.id][coord] if x is not None else None for x in node.inputs],
                    out_pl,
                    device=device,
                )
                for device, coord in root.coordinates()
            }
            for k, o in enumerate(node.outputs):
                self.shards[o.id] = {c: v[k] for c, v in per_rank.items()}

    def value(self, operand: Operand) -> torch.Tensor:
        """The global value of an operand (shards concatenated, partials reduced, replicas checked equal)."""
        assert operand.mesh is not None
        root = operand.mesh.root
        return assemble(self.shards[operand.id], root.shape, operand.root_placements)
