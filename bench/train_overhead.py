"""The controller's and workers' overhead of one eager training step (tiny Llama, 1-device mesh, CPU).

One step: forward, ``loss.backward()``, (``--clip``: ``clip_grad_norm_(foreach=True)``,) ``AdamW(foreach=True)
.step()`` on a ``dp`` mesh of ``--devices`` devices (the batch sharded when more than one). Prints, per step:
fast-path hits, misses, calls planned in full (and which ops), ops the workers ran on their general Python path
(``Worker.general``, summed over the workers), and the median step time over ``--steps`` steps (``dt.sync()``
after each: end to end).

    PYTHONPATH=$PWD python bench/train_overhead.py --steps 20
    PYTHONPATH=$PWD python bench/train_overhead.py --steps 20 --clip 1.0 --devices 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import train_gpu as tg  # noqa: E402

import torch_dtorch as dt  # noqa: E402
from torch_dtorch import Replicate, Shard  # noqa: E402
from torch_dtorch.device import fastpath  # noqa: E402
from torch_dtorch.device.state import get_session  # noqa: E402
from torch_dtorch.nn import replicate_module  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up steps)")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ max norm (0: no clipping)")
    p.add_argument("--devices", type=int, default=1, help="dp mesh size (the batch is sharded over it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    args = argparse.Namespace(
        tiny=True,
        layers=a.layers,
        seq=a.seq,
        batch=a.batch,
        dtype=getattr(torch, a.dtype),
        device="cpu",
        worker_compiler=None,
    )
    torch.manual_seed(0)
    model = tg.build(args)
    mesh = dt.init_device_mesh("cpu", (a.devices,), mesh_dim_names=("dp",))
    replicate_module(model, mesh)
    dt.match_grad_placements(model)
    ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq))
    inputs = dt.distribute_tensor(ids, mesh, [Shard(0) if a.devices > 1 else Replicate()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> Any:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip, foreach=True)
        opt.step()
        return loss.detach()

    for _ in range(3):
        step()
    dt.sync()
    ex = get_session().executor
    c = ex.constructor
    workers = list(ex.runner.workers.values())

    def general() -> Counter[str]:
        return sum((Counter(w.general) for w in workers), Counter())

    g0, h0, m0, p0 = general(), fastpath.stats["hit"], fastpath.stats["miss"], c.num_planned
    planned: Counter[str] = Counter()
    orig = type(c).call

    def spy(self: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        planned[str(op)] += 1
        return orig(self, op, *args, **kwargs)

    type(c).call = spy  # type: ignore[method-assign]
    step()
    dt.sync()
    type(c).call = orig  # type: ignore[method-assign]
    g = general() - g0
    print(
        f"per step: hits {fastpath.stats['hit'] - h0}, misses {fastpath.stats['miss'] - m0}, "
        f"planned {c.num_planned - p0}, general-path ops {sum(g.values())}"
    )
    print("planned:", dict(planned))
    print("general:", dict(g))
    times, cpu = [], []
    for _ in range(a.steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        dt.sync()
        times.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    print(
        f"step: median {1e3 * statistics.median(times):.2f} ms, min {1e3 * min(times):.2f} ms ({a.steps} steps)"
    )
    # the controller thread's own CPU time (waiting in dt.sync() costs none): what the workers and a loaded
    # machine disturb least
    print(
        f"controller CPU per step: median {1e3 * statistics.median(cpu):.2f} ms, min {1e3 * min(cpu):.2f} ms"
    )
    dt.shutdown()


if __name__ == "__main__":
    main()
