"""``dtorch diffuse``: text-to-image with a FLUX or SD3 pipeline on a dtorch mesh; writes a PNG.

Without ``--model-path`` it builds a tiny random pipeline offline (runs on any laptop in seconds; the image is
deterministic noise); ``--model-path DIR`` loads a diffusers-format folder from local disk (``save_pretrained``
output or a downloaded snapshot). Example::

    dtorch diffuse --model flux --mesh cp=2 --steps 4 --height 64 --width 64 --prompt "a red fox" --out demo.png
    dtorch diffuse --mesh tp=2 --steps 8 --cache fbc:0.12 --quant int8 --fuse    # accelerations (ExecuteConfig)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from torch_dtorch.apps.cli_args import add_mesh_arguments, mesh_parser

__all__ = ["add_parser", "main", "parse_mesh"]

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


#: ``"cp=2,tp=1,cfg=1"`` -> ``{"cp": 2}`` (axes of size 1 dropped; order kept); ``{"cp": 1}`` if all are 1
parse_mesh = mesh_parser(axes=None, all_ones=None)


def add_parser(sub: Any) -> None:
    """Register ``dtorch diffuse`` on the top-level sub-parsers."""
    p = sub.add_parser(
        "diffuse",
        help="text-to-image with FLUX / SD3 on a dtorch mesh (tiny random model by default)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=("flux", "sd3"), default="flux", help="pipeline family (default flux)")
    p.add_argument("--model-path", type=Path, default=None, help="diffusers-format folder on local disk")
    add_mesh_arguments(
        p,
        parse=parse_mesh,
        default="cp=2",
        mesh_help="mesh axes NAME=SIZE: cfg, cp (or ulysses and ring with --cp-mode both), tp (default cp=2)",
        compile_help='transformer through torch.compile(backend="dtorch")',
    )
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weights and activations")
    p.add_argument("--vae-tiling", action="store_true", help="decode the latents tile by tile")
    p.add_argument(
        "--vae-parallel",
        action="store_true",
        help="decode on the mesh: images (with --vae-tiling, every tile) sharded over all devices",
    )
    p.add_argument(
        "--cache",
        metavar="KIND[:THRESHOLD]",
        default=None,
        help="step cache: fbc:0.12 (First-Block Cache) or tea:0.25 (TeaCache); 0 computes every step",
    )
    p.add_argument(
        "--quant",
        choices=("fp8", "int8"),
        default=None,
        help="quantized linears: fp8 (CUDA, compute capability >= 8.9) or int8 (weight-only, anywhere)",
    )
    p.add_argument(
        "--fuse",
        action="store_true",
        help="fused operators (rotary, adaLN modulate, silu-linear, linear-GELU)",
    )
    p.add_argument("--steps", type=int, default=4, help="denoising steps (default 4)")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the pipeline's own")
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="T5 tokens (default: 32 tiny, the pipeline's own for --model-path)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", default="a photo of a red fox in the snow")
    p.add_argument("--out", type=Path, default=Path("image.png"), help="PNG to write (default image.png)")
    p.set_defaults(func=main)


def _load(args: argparse.Namespace) -> Any:
    import torch

    dtype = getattr(torch, _DTYPES[args.dtype])
    if args.model_path is None:
        from torch_dtorch.apps.diffusion.tiny import tiny_pipeline

        pipe = tiny_pipeline(args.model, seed=args.seed)
        return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
    if not args.model_path.is_dir():
        raise SystemExit(f"dtorch diffuse: --model-path {args.model_path} is not a folder")
    import diffusers

    cls = diffusers.FluxPipeline if args.model == "flux" else diffusers.StableDiffusion3Pipeline
    return cls.from_pretrained(args.model_path, torch_dtype=dtype, local_files_only=True)


def main(args: argparse.Namespace) -> int:
    """Run the pipeline once and write ``args.out``; prints the time per step."""
    import torch
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    import torch_dtorch as dt
    from torch_dtorch.apps.diffusion.cache import cache_report
    from torch_dtorch.apps.diffusion.config import CacheConfig, ExecuteConfig, FuseConfig, QuantizeConfig
    from torch_dtorch.apps.diffusion.parallelize import parallelize_pipeline, plan_mesh
    from torch_dtorch.errors import PipelineParallelError
    from torch_dtorch.mesh import DeviceMesh

    names, sizes = tuple(args.mesh), tuple(args.mesh.values())
    try:
        config = ExecuteConfig(
            cp_mode=args.cp_mode,
            compile=args.compile,
            vae_tiling=args.vae_tiling,
            vae_parallel=args.vae_parallel,
            cache=CacheConfig.parse(args.cache) if args.cache else None,
            quant=QuantizeConfig(kind=args.quant) if args.quant else None,
            fuse=FuseConfig() if args.fuse else None,
        )
        plan_mesh(
            DeviceMesh.from_shape(args.device, sizes, mesh_dim_names=names), config
        )  # before any worker
        mesh = dt.init_device_mesh(
            args.device, sizes, mesh_dim_names=names, simulate=args.simulate, mode=args.mode
        )
        t0 = time.perf_counter()
        pipe = _load(args)
        parallelize_pipeline(pipe, mesh, config)
    except PipelineParallelError as e:
        print(f"dtorch diffuse: error: {e}", file=sys.stderr)
        return 2
    t_load = time.perf_counter() - t0
    pipe.set_progress_bar_config(disable=True)
    bar = tqdm(total=args.steps, desc="denoising", unit="step")
    stamps = [time.perf_counter()]

    def on_step_end(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        stamps.append(time.perf_counter())
        bar.set_postfix(issue_s=f"{stamps[-1] - stamps[-2]:.3f}")
        bar.update(1)
        return kwargs

    call: dict[str, Any] = {
        "prompt": args.prompt,
        "num_inference_steps": args.steps,
        "height": args.height,
        "width": args.width,
        "generator": torch.Generator().manual_seed(args.seed),
        "callback_on_step_end": on_step_end,
    }
    if args.guidance_scale is not None:
        call["guidance_scale"] = args.guidance_scale
    msl = args.max_sequence_length or (32 if args.model_path is None else None)
    if msl is not None:
        call["max_sequence_length"] = msl
    t1 = time.perf_counter()
    try:
        image = pipe(**call).images[0]
    except PipelineParallelError as e:  # e.g. an image size whose sequence does not split over the CP devices
        bar.close()
        print(f"dtorch diffuse: error: {e}", file=sys.stderr)
        dt.shutdown()
        return 2
    total = time.perf_counter() - t1
    bar.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image.save(args.out)
    steps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    mesh_str = ",".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    print(
        f"dtorch diffuse: {args.model}{' (tiny random)' if args.model_path is None else ''} "
        f"{args.height}x{args.width}, mesh {mesh_str} ({args.mode}, {args.device}), cp_mode {args.cp_mode}, "
        f"compile {args.compile}"
        + "".join(f", {k} {v}" for k, v in (("cache", args.cache), ("quant", args.quant)) if v)
        + (", fused ops" if args.fuse else "")
        + (", VAE tiled" if args.vae_tiling else "")
        + (", VAE decode on the mesh" if args.vae_parallel else "")
    )
    if steps:  # the loop runs ahead of the devices (no per-step sync): a step's stamp is its issue time
        print(
            f"  steps: {len(steps)}, whole call {total:.3f} s ({total / len(steps):.3f} s per step, text "
            f"encoders and VAE included); issued: first step {steps[0]:.3f} s, median "
            f"{statistics.median(steps):.3f} s; load + parallelize {t_load:.3f} s"
        )
    report = cache_report(pipe)
    if report is not None:
        print(f"  {report}")
    print(f"  wrote {args.out}")
    dt.shutdown()
    return 0
