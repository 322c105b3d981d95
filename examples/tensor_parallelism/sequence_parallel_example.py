"""Sequence parallelism on a toy MLP, driven by one process (the dtorch counterpart of pytorch/examples'
``distributed/tensor_parallelism/sequence_parallel_example.py``; README.md lists what differs).

The input and the output stay sharded on dim 0 (``input_layouts=Shard(0)``, ``output_layouts=Shard(0)``): an
all-gather before ``in_proj`` and a reduce-scatter after ``out_proj`` replace the tensor-parallel all-reduce. As
upstream, a plain tensor reaching a ``Shard(0)`` input is each rank's **local** shard: every rank of the torchrun
original draws the same ``[4, 10]``, so the global batch is ``tp`` copies of it (``[4 * tp, 10]``). Run::

    python examples/tensor_parallelism/sequence_parallel_example.py --device cpu --tp 2 --check
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import torch_dtorch as dt

log = logging.getLogger("sequence_parallel_example")


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
    p.add_argument("--tp", type=int, default=2, help="sequence/tensor-parallel degree (devices in the mesh)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument(
        "--check", action="store_true", help="train a single-device twin and compare the parameters"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Train; returns the largest parameter difference from the single-device twin (``--check``), else 0."""
    args = parse(argv)
    mesh = dt.init_device_mesh(args.device, (args.tp,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    sp_model = ToyModel()
    twin = copy.deepcopy(sp_model) if args.check else None
    sp_model = dt.parallelize_module(
        sp_model,
        mesh,
        {
            "in_proj": ColwiseParallel(input_layouts=Shard(0)),
            "out_proj": RowwiseParallel(output_layouts=Shard(0)),
        },
    )
    optimizer = torch.optim.AdamW(sp_model.parameters(), lr=0.25, foreach=True)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.25, foreach=True) if twin is not None else None
    for i in range(args.iters):
        torch.manual_seed(i)
        inp = torch.rand(4, 10)  # each rank's local shard, as in the torchrun original
        output = sp_model(inp)
        assert output.shape == (4 * args.tp, 5) and output.placements == (Shard(0),)
        output.sum().backward()
        optimizer.step()
        if twin is not None and twin_opt is not None:
            twin(inp.repeat(args.tp, 1)).sum().backward()  # the global batch the shards make up
            twin_opt.step()
        log.info("sp iter %d: output sum %.4f", i, output.sum().item())
    diff = 0.0
    if twin is not None:
        for (name, p), q in zip(sp_model.named_parameters(), twin.parameters(), strict=True):
            diff = max(diff, (p.full_tensor().cpu() - q.detach()).abs().max().item())
            log.info("%s %s: max |dtorch - torch| so far %.2e", name, p.placements, diff)
    dt.shutdown()
    return diff


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(1 if main() > 1e-5 else 0)  # --check: a parameter off from torch by more than 1e-5 fails
