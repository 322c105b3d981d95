"""One training step (forward, loss backward, AdamW) of a Llama-3-8B-shaped model with fewer layers: torch vs
dtorch, one GPU.

The model is transformers' ``LlamaForCausalLM`` with the Llama-3-8B configuration (hidden 4096, 32 heads / 8 KV
heads, SwiGLU 14336, vocabulary 128256) but ``--layers`` decoder layers, **random** weights made on the device in
``--dtype``; the batch is ``--batch`` random sequences of ``--seq`` tokens (labels = inputs). One step is
``zero_grad(set_to_none=True)``, ``model(input_ids, labels).loss.backward()``, ``AdamW(foreach=True).step()``.

Modes (each a fresh model, one after the other):

- ``torch``: eager torch;
- ``inductor``: ``torch.compile(model)`` (forward and backward compiled), eager AdamW;
- ``dtorch``: a 1-device mesh, eager (``replicate_module``);
- ``dtorch-tp2``: a simulated 2-device mesh on the one GPU (``simulate=True``), the upstream TP plan, eager;
- ``dtorch-dp2``: a simulated 2-device mesh, batch sharded on ``dp`` (use ``--batch 2``), eager;
- ``dtorch-compiled``: the 1-device mesh, ``torch.compile(model, backend="dtorch")`` (forward and backward programs,
  ``--worker-compiler``: each worker compiles its program's segments with inductor, the default on CUDA), eager AdamW
  (its ``_foreach_*`` list ops);
- ``dtorch-compiled-tp2``: the simulated 2-device TP mesh, compiled the same way.

Simulated meshes run both ranks on one GPU: they measure the overheads of a 2-way run (collectives, two programs),
not a speed-up, and hold two shards' worth of memory on the one card. Targets: ``dtorch`` <= 1.10 x ``torch``,
``dtorch-compiled`` <= 1.05 x ``inductor``.

Each mode runs ``--warmup`` untimed steps and ``--repeat`` timed steps; the table shows the median step time, the
ratio to ``torch`` (target: ``dtorch`` <= 1.10) and the peak memory allocated on the GPU (every simulated rank
included), and the first step's loss (equal losses: the same weights and data in every mode).

    python bench/train_gpu.py                       # 2 layers, seq 2048, bf16, every mode
    python bench/train_gpu.py --layers 4 --modes torch dtorch
    python bench/train_gpu.py --tiny                # tiny widths on the CPU: checks that every path runs
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path too (tests)
import gpu_trace  # noqa: E402

log = logging.getLogger("bench.train_gpu")

#: meta-llama/Meta-Llama-3-8B config.json (layers from --layers)
LLAMA3_8B: dict[str, Any] = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}  # fmt: skip
TINY: dict[str, Any] = {
    "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip

MODES = ("torch", "inductor", "dtorch", "dtorch-compiled", "dtorch-tp2", "dtorch-compiled-tp2", "dtorch-dp2")

TP_PLAN_KEYS = {
    "model.embed_tokens": ("RowwiseParallel", {"input_layouts": "R"}),
    "model.layers.*.self_attn.q_proj": ("ColwiseParallel", {}),
    "model.layers.*.self_attn.k_proj": ("ColwiseParallel", {}),
    "model.layers.*.self_attn.v_proj": ("ColwiseParallel", {}),
    "model.layers.*.self_attn.o_proj": ("RowwiseParallel", {}),
    "model.layers.*.mlp.gate_proj": ("ColwiseParallel", {}),
    "model.layers.*.mlp.up_proj": ("ColwiseParallel", {}),
    "model.layers.*.mlp.down_proj": ("RowwiseParallel", {}),
    "lm_head": ("ColwiseParallel", {"output_layouts": "R"}),
}


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import parallel as tp

    layouts = {"R": Replicate()}
    return {
        k: getattr(tp, cls)(**{a: layouts[v] for a, v in kw.items()}) for k, (cls, kw) in TP_PLAN_KEYS.items()
    }


def build(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA3_8B), num_hidden_layers=args.layers)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(cfg).to(args.dtype)
    return model.train()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_mode(mode: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    if mode.startswith("dtorch"):  # only then: see run_fresh
        import torch_dtorch as dt

    model: Any = build(args)
    inputs: Any = ids
    sync: Callable[[], None] = lambda: synchronize(args.device)  # noqa: E731
    if mode == "inductor":
        model = torch.compile(model)
    elif mode.startswith("dtorch"):
        from torch_dtorch import Replicate, Shard
        from torch_dtorch.nn import replicate_module

        n = 2 if mode.endswith(("tp2", "dp2")) else 1
        axis = "tp" if mode.endswith("tp2") else "dp"
        simulate = args.device == "cuda" and n > 1
        mesh = dt.init_device_mesh(args.device, (n,), mesh_dim_names=(axis,), simulate=simulate)
        if axis == "tp":
            dt.parallelize_module(model, mesh, tp_plan())
        else:
            replicate_module(model, mesh)
        dt.match_grad_placements(model)
        inputs = dt.distribute_tensor(ids, mesh, [Shard(0) if mode == "dtorch-dp2" else Replicate()])
        if mode.startswith("dtorch-compiled"):
            model = torch.compile(model, backend="dtorch", options={"worker_compiler": args.worker_compiler})

        def sync() -> None:
            dt.sync()
            synchronize(args.device)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        opt.step()
        return loss.detach()

    first = step()
    first_loss = float(dt.to_torch(first) if mode.startswith("dtorch") else first)
    for _ in range(args.warmup - 1):
        step()
    sync()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan")
    result: dict[str, Any] = {"step_s": statistics.median(times), "peak_gib": peak, "loss": first_loss}
    if args.trace:
        summary = gpu_trace.trace_call(step, sync=sync, label=f"train-{mode}", out_dir=args.trace)
        result["trace"] = summary.lines(f"train-{mode}")
    return result


def _in_process(mode: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    return run_fresh(mode, args, ids.to(args.device), spawn=False)


def run_fresh(
    mode: str, args: argparse.Namespace, ids: torch.Tensor, *, spawn: bool | None = None
) -> dict[str, Any]:
    """:func:`run_mode`, then everything it made is dropped (the worker pool too) before the next mode.

    On CUDA each mode runs in a process of its own (``spawn``): the torch baselines must not import torch_dtorch,
    whose device becomes torch's accelerator and breaks plain-CUDA autograd in that process (pytorch/pytorch#161129,
    docs/training.md), and every mode starts from an empty GPU."""
    if spawn is None:
        spawn = args.device == "cuda"
    if spawn:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(1) as pool:
            return pool.apply(_in_process, (mode, args, ids.cpu()))
    result = run_mode(mode, args, ids)
    gc.collect()
    if mode.startswith("dtorch"):
        import torch_dtorch as dt

        dt.shutdown()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None, help="default 2048; 16 with --tiny")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--device", default=None, choices=["cuda", "cpu"], help="default cuda; cpu with --tiny"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--tiny", action="store_true", help="tiny widths on the CPU: every path runs")
    parser.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="one more step per mode under torch.profiler: prints GPU busy time, idle gaps and top kernels "
        "(bench/gpu_trace.py) and writes the Chrome trace to DIR",
    )
    parser.add_argument(
        "--worker-compiler",
        default=None,
        choices=["eager", "inductor"],
        help="dtorch-compiled modes: how workers run their programs (default inductor on cuda, eager on cpu)",
    )
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.worker_compiler = args.worker_compiler or ("inductor" if args.device == "cuda" else "eager")
    args.seq = args.seq or (16 if args.tiny else 2048)
    args.dtype = getattr(torch, args.dtype)
    if args.tiny:
        args.warmup, args.repeat = min(args.warmup, 2), min(args.repeat, 2)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    vocab = (TINY if args.tiny else LLAMA3_8B)["vocab_size"]
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ids = ids.to(args.device)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(
        f"# train_gpu: Llama-3-8B shape{' (tiny)' if args.tiny else ''}, {args.layers} layers, batch {args.batch} x "
        f"seq {args.seq}, {str(args.dtype).removeprefix('torch.')}, AdamW(foreach), {device_name}, "
        f"torch {torch.__version__}"
    )
    results: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        log.info("running %s", mode)
        results[mode] = run_fresh(mode, args, ids)
    base = results.get("torch", {}).get("step_s")
    print("| mode | step (ms) | vs torch | peak GiB | first loss |")
    print("|---|---|---|---|---|")
    for mode, r in results.items():
        ratio = f"{r['step_s'] / base:.3f}" if base else "-"
        print(f"| {mode} | {r['step_s'] * 1e3:.1f} | {ratio} | {r['peak_gib']:.2f} | {r['loss']:.5f} |")
    for r in results.values():
        for line in r.get("trace", []):
            print(line)
    inductor = results.get("inductor", {}).get("step_s")
    for mode, r in results.items():
        if inductor and mode.startswith("dtorch-compiled"):
            print(
                f"# {mode} / inductor: {r['step_s'] / inductor:.3f} (worker compiler {args.worker_compiler})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
