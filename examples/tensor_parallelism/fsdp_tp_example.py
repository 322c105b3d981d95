"""FSDP + tensor parallelism + sequence parallelism on a Llama-2 transformer, driven by one process (the dtorch
counterpart of pytorch/examples' ``distributed/tensor_parallelism/fsdp_tp_example.py``; README.md lists what differs).

A 2-D mesh ``(dp, tp)``: inside each ``tp`` group the blocks run Megatron-style (column-parallel q/k/v and w1/w3,
row-parallel wo and w2, the norms sequence-parallel on the sequence dim), and ``dt.fully_shard`` shards every
parameter ``Shard(0)`` on ``dp`` on top (all-gathered for use, gradients reduce-scattered). Run::

    python examples/tensor_parallelism/fsdp_tp_example.py --device cpu --dp 2 --tp 2 --tiny --check
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import torch_dtorch as dt

sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama2_model.py next to this script
from llama2_model import ModelArgs, Transformer  # noqa: E402

log = logging.getLogger("fsdp_tp_example")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dp", type=int, default=2, help="data-parallel (FSDP) degree")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="dim 32, 4 heads, vocab 64, sequence 16 (tests, CPU)")
    p.add_argument(
        "--check", action="store_true", help="train a single-device twin and compare the parameters"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    """Train; returns the largest parameter difference from the single-device twin (``--check``), else 0."""
    args = parse(argv)
    device_mesh = dt.init_device_mesh(args.device, (args.dp, args.tp), mesh_dim_names=("dp", "tp"))
    tp_mesh, dp_mesh = device_mesh["tp"], device_mesh["dp"]
    if args.tiny:
        model_args = ModelArgs(
            dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=32
        )
        batch, seq = 2, 16
    else:
        model_args = ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=32000)
        batch, seq = 8, 256
    torch.manual_seed(0)
    model = Transformer.from_model_args(model_args)
    model.init_weights()
    twin = copy.deepcopy(model) if args.check else None

    model = dt.parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for transformer_block in model.layers:
        layer_tp_plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(
                input_layouts=(Shard(1), Replicate()), desired_input_layouts=(Replicate(), Replicate())
            ),
            "attention.wq": ColwiseParallel(use_local_output=False),
            "attention.wk": ColwiseParallel(use_local_output=False),
            "attention.wv": ColwiseParallel(use_local_output=False),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        # as upstream (since July 2025), the head counts stay global: q/k/v keep their global shapes
        dt.parallelize_module(transformer_block, tp_mesh, layer_tp_plan)
    sharded_model = dt.fully_shard(model, mesh=dp_mesh)
    log.info("wq %s, ffn_norm %s", model.layers[0].attention.wq.weight.placements,
             model.layers[0].ffn_norm.weight.placements)  # fmt: skip

    optimizer = torch.optim.AdamW(sharded_model.parameters(), lr=3e-3, foreach=True)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=3e-3, foreach=True) if twin is not None else None
    for i in range(args.iters):
        # the original seeds each dp rank with i + dp_rank and draws its local batch: the global batch is those
        # dp batches stacked, sharded on dp (FSDP inputs are passed global here)
        parts = []
        for dp_rank in range(args.dp):
            torch.manual_seed(i + dp_rank)
            parts.append(torch.randint(model_args.vocab_size, (batch, seq)))
        inp = torch.cat(parts)
        output = sharded_model(dt.distribute_tensor(inp, device_mesh, [Shard(0), Replicate()]))
        output.sum().backward()
        optimizer.step()
        if twin is not None and twin_opt is not None:
            twin(inp).sum().backward()
            twin_opt.step()
        log.info("2D iter %d complete: output sum %.4f", i, output.sum().item())
    diff = 0.0
    if twin is not None:
        for p, q in zip(sharded_model.parameters(), twin.parameters(), strict=True):
            diff = max(diff, (p.full_tensor().cpu() - q.detach()).abs().max().item())
        log.info("max |dtorch - torch| over the parameters: %.2e", diff)
    dt.shutdown()
    return diff


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(1 if main() > 1e-5 else 0)  # --check: a parameter off from torch by more than 1e-5 fails
