"""Tensor parallelism on a toy MLP, driven by one process (the dtorch counterpart of pytorch/examples'
``distributed/tensor_parallelism/tensor_parallel_example.py``; README.md lists what differs from the torchrun
original and why).

``in_proj`` is column-parallel (its weight ``Shard(0)``), ``out_proj`` row-parallel (``Shard(1)``): the hidden
activation stays sharded between them and one all-reduce produces the output. Run::

    python examples/tensor_parallelism/tensor_parallel_example.py --device cpu --tp 2 --check
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt

log = logging.getLogger("tensor_parallel_example")


class ToyModel(nn.Module):
    """Linear(10, 32) -> ReLU -> Linear(32, 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.relu(self.in_proj(x)))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (devices in the mesh)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--check", action="store_true", help="train a single-device twin and compare the parameters"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Train; returns the largest parameter difference from the single-device twin (``--check``), else 0."""
    args = parse(argv)
    mesh = dt.init_device_mesh(args.device, (args.tp,), mesh_dim_names=("tp",))
    log.info("device mesh %s", mesh)
    torch.manual_seed(0)
    tp_model = ToyModel()
    twin = copy.deepcopy(tp_model) if args.check else None
    tp_model = dt.parallelize_module(
        tp_model, mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}
    )
    optimizer = torch.optim.AdamW(tp_model.parameters(), lr=0.25, foreach=True)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.25, foreach=True) if twin is not None else None
    for i in range(args.iters):
        torch.manual_seed(i)  # every rank of the torchrun original drew this same input
        inp = torch.rand(
            20, 10
        )  # a plain tensor reaching ColwiseParallel's Replicate input: the global value
        output = tp_model(inp)
        output.sum().backward()  # as the original: gradients accumulate over the iterations
        optimizer.step()
        if twin is not None and twin_opt is not None:
            twin(inp).sum().backward()
            twin_opt.step()
        log.info("tp iter %d: output sum %.4f", i, output.sum().item())
    diff = 0.0
    if twin is not None:
        for (name, p), q in zip(tp_model.named_parameters(), twin.parameters(), strict=True):
            diff = max(diff, (p.full_tensor().cpu() - q.detach()).abs().max().item())
            log.info("%s %s: max |dtorch - torch| so far %.2e", name, p.placements, diff)
    dt.shutdown()
    return diff


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(1 if main() > 1e-5 else 0)  # --check: a parameter off from torch by more than 1e-5 fails
