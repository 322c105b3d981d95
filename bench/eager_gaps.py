"""Eager end to end per op for the two worker hot-path gaps of issue 20, in ONE run: an op whose inputs repeat
(``x = (x * x).sqrt()``: both ops take one operand twice or once) and a per-step 0-d CPU scalar
(``x = x * t + b`` with ``t = torch.tensor(...)`` new every step, a diffusion timestep), and in-place ops
(``x.add_(b); x.sub_(b)``: the fast path of in-place ops), against plain torch.

Each cell is the median µs per aten op of ``--repeat`` chains of ``--ops`` ops (``dt.sync()`` included), with the
calls planned in full per op (``GraphConstructor.num_planned``) and, in thread mode, the ops the workers ran on
their general local path per op (``Worker.general``).

    python bench/eager_gaps.py [--ops 2000] [--repeat 5] [--no-process]
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
from collections.abc import Callable

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.device.state import get_session

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from eager_e2e import chain_us  # noqa: E402 - the same chain timing as the issue's bench

log = logging.getLogger("eager_gaps")

#: per-step scalars: a product of 1 over a cycle, so the chain's values stay put
_SCALES = (0.5, 2.0, 0.8, 1.25)


def steps(x0: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], None]]:
    """One two-op step per case, on a box holding the chain's value."""
    box = [x0]
    count = [0]

    def repeated() -> None:
        box[0] = (box[0] * box[0]).sqrt()

    def scalar() -> None:
        count[0] += 1
        t = torch.tensor(_SCALES[count[0] % len(_SCALES)])  # a new 0-d CPU tensor every step
        box[0] = box[0] * t + b

    def in_place() -> None:  # two in-place ops (the values stay put)
        box[0].add_(b)
        box[0].sub_(b)

    return {"x*x": repeated, "x*t (0-d CPU)": scalar, "x.add_(b) (in place)": in_place}


def dtorch_cells(n: int, mode: str, *, ops: int, repeat: int) -> dict[str, tuple[float, float, float]]:
    """``case -> (µs/op, planned per op, general ops per op)`` on an ``n``-device mesh."""
    mesh = dt.init_device_mesh("cpu", (n,), mode=mode)
    try:
        placements = [Shard(0)] if n > 1 else [Replicate()]
        x = dt.distribute_tensor(torch.randn(16 * n, 16).abs() + 0.5, mesh, placements)
        b = dt.distribute_tensor(torch.randn(16 * n, 16), mesh, placements)
        ex = get_session().executor
        workers = list(getattr(ex.runner, "workers", {}).values())
        out = {}
        for case, step in steps(x, b).items():
            planned, general = ex.constructor.num_planned, sum(sum(w.general.values()) for w in workers)
            us = chain_us(step, dt.sync, ops=ops, repeat=repeat)
            total = ops * (repeat + 1)  # the warm-up chain and the timed ones
            out[case] = (
                us,
                (ex.constructor.num_planned - planned) / total,
                (sum(sum(w.general.values()) for w in workers) - general) / total / max(1, len(workers)),
            )
        return out
    finally:
        dt.shutdown()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--no-process", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    kw = {"ops": args.ops, "repeat": args.repeat}
    x, b = torch.randn(16, 16).abs() + 0.5, torch.randn(16, 16)
    base = {case: chain_us(step, lambda: None, **kw) for case, step in steps(x, b).items()}
    cases = [(1, "thread"), (4, "thread")] + ([] if args.no_process else [(1, "process")])
    rows = [(f"dtorch {n}-dev {mode}", dtorch_cells(n, mode, **kw)) for n, mode in cases]
    log.info(
        "# eager e2e per op, µs/op (dt.sync() included); cpu (%s, %s cores, torch %s); median of %d chains of %d "
        "ops; planned: calls planned in full per op; general: worker ops on the general path per op and worker "
        "(thread mode)",
        platform.machine(), os.cpu_count(), torch.__version__, args.repeat, args.ops,
    )  # fmt: skip
    log.info("| case | %s |", " | ".join(f"{c} µs/op (planned, general)" for c in base))
    log.info("|---|%s", "---|" * len(base))
    log.info("| torch eager | %s |", " | ".join(f"{us:.1f}" for us in base.values()))
    for label, cells in rows:
        log.info(
            "| %s | %s |", label, " | ".join(f"{us:.1f} ({pl:.2f}, {g:.2f})" for us, pl, g in cells.values())
        )


if __name__ == "__main__":
    main()
