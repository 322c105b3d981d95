"""The whole denoising loop of a FLUX.1-dev-sized (or SD3-medium-sized) pipeline: diffusers vs dtorch, one GPU.

The transformer has the public configuration (FLUX.1-dev: 19 double + 38 single blocks, 24 heads x 128; SD3-medium:
24 joint blocks, 24 heads x 64) with **random** weights created directly on the device in ``--dtype`` (nothing is
downloaded); the VAE has the real configuration, random too. The text encoders are left out: the pipeline gets
random ``prompt_embeds`` (512 T5 tokens), as diffusers allows, so the time is the denoising loop — scheduler,
latent handling and the transformer, every step — for ``--steps`` steps at ``--size``² (``output_type="latent"``).
SD3 runs classifier-free guidance (batch 2 per step).

Modes (each a fresh pipeline, one after the other, so only one set of weights is alive):

- ``diffusers``: the pipeline as is (eager);
- ``inductor``: ``pipe.transformer = torch.compile(pipe.transformer)``;
- ``dtorch``: ``parallelize_pipeline`` on a 1-device mesh, eager;
- ``dtorch-compiled``: the same with ``ExecuteConfig(compile=True)`` (workers compile with inductor);
- ``ulysses4``: a simulated 4-device mesh on the one GPU (``simulate=True``; axis ``cp``, Ulysses), compiled. The
  four ranks share one GPU, so this measures the overheads of a 4-way run (all-to-alls, four programs), not a
  speed-up; it holds four copies of the weights.

Accelerations (``ExecuteConfig``, issue 22) add rows to every dtorch mode, cumulatively in this order (``--no-ladder``:
only the row with all of them): ``--quant fp8|int8`` (quantized linears), ``--fuse`` (fused operators),
``--cache-skip F`` (a First-Block Cache forced to skip the fraction ``F`` of the steps: with random weights a
threshold means nothing, so the skip pattern is fixed; the distance is still computed every step). The baselines
(``diffusers``, ``inductor``) stay bf16 and uncached. Targets on one H200: ``dtorch-compiled+fp8`` <= 0.80 x
``inductor`` per step; ``--steps 28`` with fp8 + compile + a 50 % skip cache <= 1.5 s for the loop.

Each mode runs ``--warmup`` untimed calls (compilation happens there) and ``--repeat`` timed calls; the table shows
the median loop time, the time per step, the ratio to ``inductor`` (target: ``dtorch-compiled`` <= 1.02), and for dtorch
modes the values fetched from the workers per call (each a sync; 1 when the denoising loop stays on the mesh, plus one
per step with a step cache, whose skip decision reads a scalar).

At full size every compiled mode spends about two minutes compiling in its warm-up call (FLUX.1-dev: inductor
125 s, dtorch 120 s, docs/benchmarks.md), so a run with several compiled rows may not fit a device session's command
limit: run one or two rows per command with ``--save FILE`` and print them as one table, with the targets, by
``--report FILE ...`` (runs nothing; the rows must share model, size, dtype and device). The table's last lines are
the three targets — ``dtorch-compiled / inductor`` <= 1.02, ``dtorch-compiled+fp8 / inductor`` <= 0.80, and the
28-step loop of the fastest ``dtorch-compiled+fp8`` row with ``--cache-skip 0.5`` <= 1.5 s — each ``met``,
``NOT met`` or ``not run``.

    python bench/flux_gpu.py                           # FLUX.1-dev size, 1024x1024, 28 steps, every mode
    python bench/flux_gpu.py --model sd3               # SD3-medium size
    python bench/flux_gpu.py --modes inductor dtorch-compiled --layers 4 8
    python bench/flux_gpu.py --modes inductor dtorch-compiled --quant fp8 --fuse --cache-skip 0.5
    python bench/flux_gpu.py --tiny                    # tiny widths on the CPU: checks that every path runs
    python bench/flux_gpu.py --modes inductor --save a.pt      # one compiled row per command ...
    python bench/flux_gpu.py --modes dtorch-compiled --quant fp8 --accelerated-only --save b.pt
    python bench/flux_gpu.py --report a.pt b.pt        # ... one table and the targets
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # loaded by path too (tests)
import gpu_trace  # noqa: E402

log = logging.getLogger("bench.flux_gpu")

#: black-forest-labs/FLUX.1-dev transformer/config.json
FLUX_DEV: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}  # fmt: skip
#: stabilityai/stable-diffusion-3-medium-diffusers transformer/config.json
SD3_MEDIUM: dict[str, Any] = {
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 192,
}  # fmt: skip
#: the FLUX / SD3 VAE (16 latent channels, 8x downscale)
VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 16, "block_out_channels": (128, 256, 512, 512),
    "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
    "layers_per_block": 2, "norm_num_groups": 32,
}  # fmt: skip
#: CPU check: the same structure at toy widths
TINY = {
    "flux": {**FLUX_DEV, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
             "num_attention_heads": 4, "joint_attention_dim": 32, "pooled_projection_dim": 16,
             "axes_dims_rope": (4, 6, 6)},
    "sd3": {**SD3_MEDIUM, "sample_size": 16, "in_channels": 4, "num_layers": 1, "attention_head_dim": 8,
            "num_attention_heads": 4, "joint_attention_dim": 32, "caption_projection_dim": 32,
            "pooled_projection_dim": 16, "out_channels": 4, "pos_embed_max_size": 32},
}  # fmt: skip
TINY_VAE = {**VAE, "latent_channels": 4, "block_out_channels": (8, 8), "down_block_types": VAE["down_block_types"][:2],
            "up_block_types": VAE["up_block_types"][:2], "layers_per_block": 1, "norm_num_groups": 8}  # fmt: skip
MODES = ("diffusers", "inductor", "dtorch", "dtorch-compiled", "ulysses4")
BASELINES = ("diffusers", "inductor")


class Row(NamedTuple):
    """One timed configuration: a mode and the accelerations applied to it (dtorch modes only)."""

    mode: str
    quant: str | None = None
    fuse: bool = False
    cache_skip: float | None = None
    cudagraphs: bool = False

    @property
    def name(self) -> str:
        name = self.mode + (f"+{self.quant}" if self.quant else "") + ("+fuse" if self.fuse else "")
        name += f"+cache{self.cache_skip:g}" if self.cache_skip else ""
        return name + ("+cudagraphs" if self.cudagraphs else "")


class Timing(NamedTuple):
    """One row's result: the timed calls' loop times (s), the last call's latents, the step cache's skips, and the
    values fetched from the workers per timed call (dtorch modes: 1 when the loop stays on the mesh)."""

    times: list[float]
    latents: torch.Tensor
    skipped: str
    fetches: float | None


@contextlib.contextmanager
def count_fetches(enabled: bool) -> Iterator[list[int]]:
    """Count the controller's value fetches (``full_tensor``, ``item``: each a sync) while the block runs."""
    count = [0]
    if not enabled:
        yield count
        return
    from torch_dtorch.executor.eager import EagerGraphExecutor

    fetch = EagerGraphExecutor.fetch

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return fetch(self, *args, **kwargs)

    EagerGraphExecutor.fetch = counting  # type: ignore[method-assign]
    try:
        yield count
    finally:
        EagerGraphExecutor.fetch = fetch  # type: ignore[method-assign]


def rows(args: argparse.Namespace) -> list[Row]:
    """The rows to time: each mode, and for dtorch modes the accelerations (cumulative with ``--ladder``)."""
    steps: list[dict[str, Any]] = []
    if args.quant:
        steps.append({"quant": args.quant})
    if args.fuse:
        steps.append({"fuse": True})
    if args.cache_skip:
        steps.append({"cache_skip": args.cache_skip})
    out = []
    for mode in args.modes:
        if mode in BASELINES or not steps or not args.accelerated_only:
            out.append(Row(mode))
        if mode in BASELINES or not steps:
            continue
        acc: dict[str, Any] = {}
        for i, step in enumerate(steps):
            acc |= step
            if args.ladder or i == len(steps) - 1:
                out.append(Row(mode, **acc))
    if getattr(args, "cudagraphs", False):  # (one rank per GPU: not the simulated ulysses4 mesh)
        out = [r._replace(cudagraphs=True) if r.mode == "dtorch-compiled" else r for r in out]
    return out


def _build(cls: Any, config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """``cls(**config)`` with random weights created in ``dtype`` directly on ``device``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            module = cls(**config)
    finally:
        torch.set_default_dtype(previous)
    return module.eval().requires_grad_(False)


def build_pipeline(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Any:
    import diffusers

    torch.manual_seed(0)
    flux = args.model == "flux"
    config = dict(TINY[args.model] if args.tiny else (FLUX_DEV if flux else SD3_MEDIUM))
    if args.layers:
        config["num_layers"] = args.layers[0]
        if flux:
            config["num_single_layers"] = args.layers[1]
    cls = diffusers.FluxTransformer2DModel if flux else diffusers.SD3Transformer2DModel
    transformer = _build(cls, config, device, dtype)
    vae_config = {
        **(TINY_VAE if args.tiny else VAE),
        "use_quant_conv": not flux,
        "use_post_quant_conv": not flux,
    }
    vae = _build(diffusers.AutoencoderKL, vae_config, device, dtype)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=3.0 if not flux else 1.0, use_dynamic_shifting=flux, base_shift=0.5, max_shift=1.15
    )
    none = {"text_encoder": None, "tokenizer": None, "text_encoder_2": None, "tokenizer_2": None}
    if flux:
        return diffusers.FluxPipeline(scheduler=scheduler, vae=vae, transformer=transformer, **none)
    none |= {"text_encoder_3": None, "tokenizer_3": None}
    return diffusers.StableDiffusion3Pipeline(scheduler=scheduler, vae=vae, transformer=transformer, **none)


def call_kwargs(
    pipe: Any, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """Random prompt embeddings in place of the text encoders, and the loop's settings."""
    g = torch.Generator().manual_seed(1)
    cfg = pipe.transformer.config
    text = args.text_tokens

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    kw: dict[str, Any] = {
        "prompt_embeds": randn(1, text, cfg.joint_attention_dim),
        "pooled_prompt_embeds": randn(1, cfg.pooled_projection_dim),
        "num_inference_steps": args.steps,
        "height": args.size,
        "width": args.size,
        "output_type": "latent",
    }
    if args.model == "sd3":
        kw["negative_prompt_embeds"] = randn(1, text, cfg.joint_attention_dim)
        kw["negative_pooled_prompt_embeds"] = randn(1, cfg.pooled_projection_dim)
        kw["guidance_scale"] = 7.0
    else:
        kw["guidance_scale"] = 3.5
    return kw


def prepare(row: Row, pipe: Any, args: argparse.Namespace) -> Any:
    mode = row.mode
    if mode == "diffusers":
        return pipe
    if mode == "inductor":
        pipe.transformer = torch.compile(pipe.transformer)
        return pipe
    import torch_dtorch as dt
    from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline
    from torch_dtorch.apps.diffusion.config import CacheConfig, FuseConfig, QuantizeConfig

    n = 4 if mode == "ulysses4" else 1
    simulate = args.device == "cuda" and n > 1
    mesh = dt.init_device_mesh(
        args.device, (n,), mesh_dim_names=("cp",), simulate=simulate, mode=args.worker_mode
    )
    compiled = mode in ("dtorch-compiled", "ulysses4")
    config = ExecuteConfig(
        cp_mode="ulysses",
        compile=compiled,
        # fp8 on the CPU (--tiny) runs its float emulation: it checks the path, its time means nothing
        quant=QuantizeConfig(kind=row.quant, allow_emulation=args.device != "cuda") if row.quant else None,  # type: ignore[arg-type]
        fuse=FuseConfig() if row.fuse else None,
        cache=CacheConfig(kind="fbc", force_skip=row.cache_skip) if row.cache_skip else None,
        cudagraphs=row.cudagraphs,
    )
    return parallelize_pipeline(pipe, mesh, config)


def time_mode(row: Row, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Timing:
    mode = row.name
    pipe = build_pipeline(args, device, dtype)
    kw = call_kwargs(pipe, args, device, dtype)
    pipe = prepare(row, pipe, args)
    pipe.set_progress_bar_config(disable=True)
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = None
    for i in range(args.warmup):
        t0 = time.perf_counter()
        out = pipe(**kw, generator=torch.Generator().manual_seed(0)).images
        sync()
        log.info("%s: warm-up call %d: %.2f s", mode, i, time.perf_counter() - t0)
    times = []
    with count_fetches(row.mode not in BASELINES) as fetched:
        for _ in range(args.repeat):
            sync()
            t0 = time.perf_counter()
            out = pipe(**kw, generator=torch.Generator().manual_seed(0)).images
            sync()
            times.append(time.perf_counter() - t0)
    fetches = None if row.mode in BASELINES else fetched[0] / args.repeat
    if args.trace:
        gpu_trace.trace_call(
            functools.partial(pipe, **kw, generator=torch.Generator().manual_seed(0)),
            sync=sync,
            label=f"{args.model}-{mode}",
            out_dir=args.trace,
        )
    assert out is not None
    result = out.float().cpu()
    skipped = ""
    if row.cache_skip:
        from torch_dtorch.apps.diffusion.cache import cache_report

        report = cache_report(pipe)
        skipped = "" if report is None else f"{len(report.skipped)}/{report.num_steps}"
    del pipe, kw, out
    if row.mode not in BASELINES:
        import torch_dtorch as dt

        dt.shutdown()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return Timing(times, result, skipped, fetches)


class Result(NamedTuple):
    """One row as saved (``--save``) and reported: the row, its timing, the run's settings."""

    row: Row
    timing: Timing
    steps: int
    setting: str  # model, size, dtype, device: rows compare only within one setting


#: the issue's targets: (what, row name or predicate, limit)
LOOP_TARGET_S = 1.5


def _setting(args: argparse.Namespace, dtype: torch.dtype) -> str:
    return (
        f"{args.model} ({'tiny' if args.tiny else 'full size'}"
        + (f", layers {args.layers[0]}+{args.layers[1]}" if args.layers else "")
        + f"), {args.size}x{args.size}, {str(dtype).removeprefix('torch.')}, {args.device}"
    )


def _per_step(r: Result) -> float:
    return statistics.median(r.timing.times) / r.steps


def _targets(results: list[Result]) -> list[str]:
    """The issues' three targets, each with its measured value (or why it is missing)."""
    by_name = {r.row.name: r for r in results}
    base = by_name.get("inductor")
    lines = ["targets (issues 21 / 22; the limits are for one H200, full size, 1024x1024, bf16):"]

    def ratio(name: str, limit: float, what: str) -> None:
        r = by_name.get(name)
        if base is None or r is None:
            missing = " and ".join(n for n in ("inductor", name) if n not in by_name)
            lines.append(f"  {what:<52} {'-':>8}  <= {limit:<5g} not run ({missing} missing)")
            return
        v = _per_step(r) / _per_step(base)
        lines.append(f"  {what:<52} {v:>8.3f}  <= {limit:<5g} {'met' if v <= limit else 'NOT met'}")

    ratio("dtorch-compiled", 1.02, "ratio: dtorch-compiled / inductor, whole step")
    ratio("dtorch-compiled+fp8", 0.80, "ratio: dtorch-compiled+fp8 / inductor (bf16)")
    loop = [
        r for r in results
        if r.row.mode == "dtorch-compiled" and r.row.quant == "fp8" and r.row.cache_skip == 0.5
    ]  # fmt: skip
    what = "loop: 28 steps, fp8 + compile + 50 % skip cache"
    if not loop:
        lines.append(f"  {what:<52} {'-':>8}  <= {LOOP_TARGET_S:<5g} not run (--quant fp8 --cache-skip 0.5)")
    else:
        best = min(loop, key=_per_step)
        seconds = _per_step(best) * 28
        note = "" if best.steps == 28 else f" (from {best.steps} steps)"
        verdict = "met" if seconds <= LOOP_TARGET_S else "NOT met"
        lines.append(
            f"  {what:<52} {seconds:>7.2f}s  <= {LOOP_TARGET_S:<5g} {verdict}: {best.row.name}{note}"
        )
    return lines


def report(results: list[Result]) -> None:
    """The table (every row against ``inductor``, else the first row) and the targets."""
    settings = sorted({r.setting for r in results})
    if len(settings) > 1:
        sys.exit(f"flux_gpu --report: the files mix settings {settings}; report each setting by itself")
    names = [r.row.name for r in results]
    base = results[names.index("inductor")] if "inductor" in names else results[0]
    steps = sorted({r.steps for r in results})
    print(f"\n{settings[0]}, {'/'.join(map(str, steps))} steps; median of the timed calls")
    width = max(16, *(len(n) for n in names))
    head = f"{'mode':<{width}} {'loop s':>9} {'ms/step':>9} {'vs ' + base.row.name:>13} {'skipped':>8}"
    print(f"{head} {'fetch/call':>10} {'max |latent diff|':>18}")
    for r in results:
        t = statistics.median(r.timing.times)
        diff = float((r.timing.latents - base.timing.latents).abs().max())
        line = f"{r.row.name:<{width}} {t:>9.3f} {_per_step(r) * 1e3:>9.1f} {_per_step(r) / _per_step(base):>13.3f}"
        fetches = "-" if r.timing.fetches is None else f"{r.timing.fetches:g}"
        print(f"{line} {r.timing.skipped or '-':>8} {fetches:>10} {diff:>18.3g}")
    print("\n".join(_targets(results)))


def save(path: str, results: list[Result]) -> None:
    """``results`` as a torch file that ``--report`` reads (rows of several runs combine into one table)."""
    torch.save([r._asdict() | {"row": r.row._asdict(), "timing": r.timing._asdict()} for r in results], path)


def load(paths: list[str]) -> list[Result]:
    out = []
    for path in paths:
        for raw in torch.load(path, weights_only=False):
            row, timing = Row(**raw.pop("row")), Timing(**raw.pop("timing"))
            out.append(Result(row=row, timing=timing, **raw))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", choices=("flux", "sd3"), default="flux")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--tiny", action="store_true", help="toy widths, 1 block, 64x64, 4 steps, on the CPU")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default=None, help="default cuda (cpu with --tiny)"
    )
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--layers", type=int, nargs=2, metavar=("DOUBLE", "SINGLE"), help="block counts")
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default 1024; 64 tiny)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 28; 4 tiny)")
    parser.add_argument("--text-tokens", type=int, default=None, help="prompt tokens (default 512; 16 tiny)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per mode (compilation)")
    parser.add_argument("--repeat", type=int, default=2, help="timed calls per mode")
    parser.add_argument(
        "--quant", choices=("fp8", "int8"), default=None, help="+ quantized linears (dtorch modes)"
    )
    parser.add_argument("--fuse", action="store_true", help="+ fused operators (dtorch modes)")
    parser.add_argument(
        "--cache-skip",
        type=float,
        default=None,
        metavar="F",
        help="+ a step cache forced to skip this fraction",
    )
    parser.add_argument(
        "--ladder",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one row per added acceleration (default) or only the row with all of them (--no-ladder)",
    )
    parser.add_argument(
        "--accelerated-only",
        action="store_true",
        help="with --quant/--fuse/--cache-skip: leave out the dtorch modes' plain rows",
    )
    parser.add_argument(
        "--worker-mode",
        choices=("thread", "process"),
        default="thread",
        help="dtorch modes: worker threads in this process (default) or worker processes",
    )
    parser.add_argument(
        "--cudagraphs",
        action="store_true",
        help="compiled dtorch modes: workers capture their inductor segments in CUDA graphs (ExecuteConfig)",
    )
    parser.add_argument("--save", metavar="FILE", default=None, help="also save the rows for --report")
    parser.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="after the timed calls, one more call per mode under torch.profiler: logs GPU busy time, idle gaps and "
        "top kernels (bench/gpu_trace.py) and writes the Chrome trace to DIR",
    )
    parser.add_argument(
        "--report",
        nargs="+",
        metavar="FILE",
        default=None,
        help="print one table and the targets from files of --save (several runs: e.g. one compiled mode each, "
        "when a full-size compile per mode does not fit one command); runs nothing",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.report:
        report(load(args.report))
        return 0
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.size = args.size or (64 if args.tiny else 1024)
    args.steps = args.steps or (4 if args.tiny else 28)
    args.text_tokens = args.text_tokens or (16 if args.tiny else 512)
    dtype = getattr(torch, args.dtype or ("float32" if args.device == "cpu" else "bfloat16"))
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "flux_gpu: no CUDA device (torch.cuda.is_available() is False); use --tiny for the CPU check"
        )
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cpu":
        torch.set_num_threads(1)

    setting = _setting(args, dtype)
    results = []
    for row in rows(args):
        results.append(Result(row, time_mode(row, args, device, dtype), args.steps, setting))
    if args.save:
        save(args.save, results)
    report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
