"""A randomized program of interleaved op chains for the worker stream-ordering tests.

``chains`` accumulators live on the mesh with changing placements; each step picks one chain and does one of:
an update with a replicated operand (a redistribute R -> S feeds the compute stream), a redistribute of the chain,
a cross-chain add (mixed placements), a fresh upload replacing the chain's operand (the old one is freed), a fetch
of the chain mid-way, or a matmul. The same program runs on plain torch (CPU, float64) alongside, and every fetch
is compared with it. Memory is reused all the time (same shapes, frees every step), which is what exposes a block
handed out again while another stream still reads it (issue 17: a redistribute output freed after its compute-stream
reader was launched, before it ran).
"""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard


class StressResult(NamedTuple):
    steps: int
    fetches: int
    redistributes: int


def run_interleaved_program(
    mesh: dt.DeviceMesh, *, seed: int, steps: int, chains: int = 4, rows: int = 64, cols: int = 48
) -> StressResult:
    """Run the program on ``mesh``; raise ``AssertionError`` at the first fetch that differs from torch."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    placements = [[Shard(0)], [Shard(1)], [Replicate()]]

    def fresh(k: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, dtype=torch.float64) + k

    ref_m = [fresh(k) for k in range(chains)]
    ref_acc = [torch.zeros(rows, cols, dtype=torch.float64) for _ in range(chains)]
    ref_w = torch.randn(cols, cols, generator=gen, dtype=torch.float64) / cols**0.5
    m = [dt.distribute_tensor(t.float(), mesh, [Replicate()]) for t in ref_m]
    acc = [dt.distribute_tensor(t.float(), mesh, [Shard(0)]) for t in ref_acc]
    w = dt.distribute_tensor(ref_w.float(), mesh, [Replicate()])
    fetches = redistributes = 0

    def check(j: int) -> None:
        got = acc[j].full_tensor().cpu().double()
        torch.testing.assert_close(got, ref_acc[j], atol=1e-3, rtol=1e-3, msg=lambda s: f"chain {j}: {s}")

    for _ in range(steps):
        j = rng.randrange(chains)
        r = rng.random()
        if r < 0.40:
            acc[j] = acc[j] * 0.5 + m[j]
            ref_acc[j] = ref_acc[j] * 0.5 + ref_m[j]
        elif r < 0.55:
            acc[j] = acc[j].redistribute(mesh, rng.choice(placements))
            redistributes += 1
        elif r < 0.68:
            k = rng.randrange(chains)
            acc[j] = (acc[j] + acc[k]) * 0.5
            ref_acc[j] = (ref_acc[j] + ref_acc[k]) * 0.5
        elif r < 0.80:
            ref_m[j] = fresh(j)
            m[j] = dt.distribute_tensor(ref_m[j].float(), mesh, rng.choice(placements))
        elif r < 0.88:
            check(j)
            fetches += 1
        else:
            acc[j] = torch.relu(acc[j]) @ w
            ref_acc[j] = torch.relu(ref_acc[j]) @ ref_w
    for j in range(chains):
        check(j)
    return StressResult(steps=steps, fetches=fetches + chains, redistributes=redistributes)
