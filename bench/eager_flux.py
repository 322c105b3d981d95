"""One FLUX.1-dev-shaped transformer step, **eager**: torch vs dtorch on a 1-device mesh, on the same weights.

The model is diffusers' ``FluxTransformer2DModel`` with the public FLUX.1-dev configuration (19 double + 38 single
blocks, 24 heads x 128) and random weights (bf16 on CUDA, float32 on CPU; nothing is downloaded); ``--layers D S``
shrinks it, and on the CPU the widths are tiny (the structure is the same). Both run eagerly in ``--rounds``
alternating rounds (warm-up, then ``--steps`` synchronized steps; the order flips every round); each is the median of
all its timed steps. Printed: both medians, the ratio dtorch / torch (issue 20's target on an H200: <= 1.05), whether
the outputs are bit-identical, and the eager fast path's figures for one step (hits, misses, the calls planned in
full: ``GraphConstructor.num_planned``, and in thread mode the ops the workers ran on their general local path:
``Worker.general``).

    python bench/eager_flux.py                                  # full size, CUDA, thread mode
    python bench/eager_flux.py --layers 2 4                     # part of the model
    python bench/eager_flux.py --mode process --layers 2 4      # worker processes
    python bench/eager_flux.py --device cpu --layers 1 1        # tiny widths on the CPU (the smoke test runs this)
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_flux_gpu import FLUX_DEV, TINY, build_model, distribute_module, make_inputs, time_steps  # noqa: E402

log = logging.getLogger("bench.eager_flux")


def step_figures(step: Any, sync: Any, mesh: Any) -> dict[str, Any]:
    """Fast-path hits and misses and fully planned calls of one dtorch step (after warm-up), and the ops the
    workers ran on their general local path (not replayed), per operator name (thread mode; summed over workers)."""
    from collections import Counter

    from torch_dtorch.device import fastpath
    from torch_dtorch.device.state import get_session

    executor = get_session().executor
    constructor = executor.constructor
    workers = [  # (a shared pool may hold more workers than the mesh; process mode: none in this process)
        w for w in getattr(executor.runner, "workers", {}).values() if w.device in mesh.devices
    ]
    sync()
    general = sum((Counter(w.general) for w in workers), Counter())
    guard = constructor.memory
    settles = guard.settles if guard is not None else 0
    hits, misses, planned = fastpath.stats["hit"], fastpath.stats["miss"], constructor.num_planned
    step()
    sync()
    after = sum((Counter(w.general) for w in workers), Counter())
    return {
        "hits": fastpath.stats["hit"] - hits,
        "misses": fastpath.stats["miss"] - misses,
        "planned": constructor.num_planned - planned,
        "worker_general": dict(after - general) if workers else None,
        # the memory check's settles (flush, wait for the workers and their GPU queue) in the step
        "settles": (guard.settles - settles) if guard is not None else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--mode", default="thread", choices=["thread", "process"])
    parser.add_argument(
        "--layers", type=int, nargs=2, metavar=("DOUBLE", "SINGLE"), help="block counts (default 19 38)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of torch then dtorch, alternating the order"
    )
    parser.add_argument("--image-tokens", type=int, default=None, help="default 4096 (1024x1024); 64 on CPU")
    parser.add_argument("--text-tokens", type=int, default=None, help="default 512; 16 on CPU")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("eager_flux: no CUDA device (torch.cuda.is_available() is False); try --device cpu")
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    config = dict(TINY if cpu else FLUX_DEV)
    if args.layers:
        config.update(num_layers=args.layers[0], num_single_layers=args.layers[1])
    dtype = torch.float32 if cpu else torch.bfloat16
    image_tokens = args.image_tokens or (64 if cpu else 4096)
    text_tokens = args.text_tokens or (16 if cpu else 512)
    sync = torch.cuda.synchronize if not cpu else (lambda: None)
    threads = torch.get_num_threads()
    if cpu:
        # tiny ops: one intra-op thread for both (with 2, torch eager's OpenMP team spins against the dtorch
        # worker thread on a 2-core machine: 220 ms per step instead of 2 ms)
        torch.set_num_threads(1)
    try:
        return _run(args, config, device, dtype, image_tokens, text_tokens, sync)
    finally:
        torch.set_num_threads(threads)


def _run(
    args: argparse.Namespace,
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    image_tokens: int,
    text_tokens: int,
    sync: Any,
) -> dict[str, Any]:

    import torch_dtorch as dt

    log.info(
        "FLUX transformer, eager: %d double + %d single blocks, %d heads x %d, %s on %s; %d image + %d text "
        "tokens; dtorch %s mode; torch %s",
        config["num_layers"], config["num_single_layers"], config["num_attention_heads"],
        config["attention_head_dim"], str(dtype).removeprefix("torch."), device, image_tokens, text_tokens,
        args.mode, torch.__version__,
    )  # fmt: skip
    model = build_model(config, device, dtype)
    inputs = make_inputs(config, image_tokens, text_tokens, device, dtype)
    mesh = dt.init_device_mesh(args.device, (1,), mode=args.mode)
    model_d = copy.deepcopy(model)
    distribute_module(model_d, mesh)
    gc.collect()
    # what dt's replicate_module / parallelize_* do once a model is on the mesh (torch_dtorch/device/heap.py);
    # the torch rows run after it too, so both sides see the same frozen heap
    from torch_dtorch.device.heap import freeze_startup_heap

    freeze_startup_heap("bench/eager_flux.py")
    din = {k: dt.distribute_tensor(v, mesh) for k, v in inputs.items()}

    def dsync() -> None:
        dt.sync()
        sync()

    with torch.no_grad():

        def step_t() -> Any:
            return model(**inputs, return_dict=False)[0]

        def step_d() -> Any:
            return model_d(**din, return_dict=False)[0]

        times_t: list[float] = []
        times_d: list[float] = []
        ref = out = None
        for r in range(args.rounds):
            order = [(step_t, sync, times_t), (step_d, dsync, times_d)]
            for step, sync_fn, times in order if r % 2 == 0 else order[::-1]:
                took, last = time_steps(step, sync_fn, args.warmup, args.steps)
                times.extend(took)
                if step is step_t:
                    ref = last
                else:
                    out = last
        figures = step_figures(step_d, dsync, mesh)
        assert ref is not None and out is not None
        got = out.full_tensor().cpu()
        ref = ref.cpu()
    t_torch, t_dtorch = statistics.median(times_t), statistics.median(times_d)
    identical = bool(torch.equal(got, ref))
    result = {
        "torch_ms": t_torch * 1e3,
        "dtorch_ms": t_dtorch * 1e3,
        "ratio": t_dtorch / t_torch,
        "bit_identical": identical,
        **figures,
    }
    log.info("%-34s %10.2f ms", "torch eager", t_torch * 1e3)
    log.info("%-34s %10.2f ms", f"dtorch eager, 1-device {args.mode}", t_dtorch * 1e3)
    log.info("ratio dtorch / torch = %.3f (H200 target <= 1.05)", result["ratio"])
    log.info("bit-identical: %s", identical)
    log.info(
        "per dtorch step: %d fast-path hits, %d misses, %d calls planned in full, %s memory-check settles",
        figures["hits"], figures["misses"], figures["planned"], figures["settles"],
    )  # fmt: skip
    if figures["worker_general"] is not None:
        log.info(
            "per dtorch step, ops on the workers' general path (not replayed): %s", figures["worker_general"]
        )
    dt.shutdown()
    return result


if __name__ == "__main__":
    main()
