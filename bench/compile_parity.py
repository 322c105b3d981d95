"""What inductor compiles for a FLUX transformer: plain ``torch.compile`` vs ``backend="dtorch"`` on a 1-device mesh.

``--model sd3`` compares the SD3-medium pipeline instead (the ``pipeline`` path only; its transformer has one block
kind, so ``--layers N M`` takes ``N`` joint blocks).

Counts, side by side, for each ``--layers`` setting (double and single blocks) and each ``--path``:

- ``transformer``: ``torch.compile(model)`` vs ``torch.compile(model, backend="dtorch",
  options={"worker_compiler": "inductor"})`` with every parameter a Replicate dtorch tensor (as
  ``bench/compile_flux_gpu.py``), one forward step;
- ``pipeline``: the ``FluxPipeline`` of ``bench/flux_gpu.py`` with ``pipe.transformer = torch.compile(...)`` vs
  ``parallelize_pipeline(pipe, mesh, ExecuteConfig(compile=True, worker_compiler="inductor"))`` on a 1-device
  ``cp`` mesh, one denoising step (``--steps``).

For each side every graph inductor lowers is recorded (the dtorch workers' compiles included:
``torch_dtorch.backend.parity.InductorCapture``): the post-grad FX graph's ops and copies, the generated wrapper's
kernel launches, copy-only kernels, extern calls (mm / addmm / bmm), aten fallbacks (attention), ``empty_strided``
buffers, and the inputs inductor treats as static (parameters: never alignment-checked, never copied into a CUDA
graph's pool) or checks every call. ``!`` marks the rows that differ; the post-grad ops that differ are listed
below the table. ``--dump DIR`` writes each side's generated code.

    python bench/compile_parity.py                              # tiny widths on the CPU, 1+1 blocks, both paths
    python bench/compile_parity.py --layers 1 1 4 8 --dtype bfloat16
    python bench/compile_parity.py --model sd3 --path pipeline --steps 2
    python3 bench/compile_parity.py --device cuda --layers 4 8  # FLUX.1-dev widths, 1024x1024, bf16, on one GPU

On CUDA the default is the full FLUX.1-dev width (``--tiny`` for the toy widths); on the CPU the tiny widths.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import compile_flux_gpu as cfg  # noqa: E402
import flux_gpu as fg  # noqa: E402

from torch_dtorch.backend.parity import InductorCapture, op_diff, side_by_side, totals  # noqa: E402

log = logging.getLogger("bench.compile_parity")


def _transformer_run(side: str, config: dict[str, Any], args: argparse.Namespace) -> InductorCapture:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = cfg.build_model(config, device, dtype)
    inputs = cfg.make_inputs(config, args.image_tokens, args.text_tokens, device, dtype)
    cap = InductorCapture()
    with torch.no_grad():
        if side == "inductor":
            with cap:
                torch.compile(model)(**inputs, return_dict=False)
        else:
            import torch_dtorch as dt
            from torch_dtorch.backend import dtorch_backend

            mesh = dt.init_device_mesh(args.device, (1,))
            cfg.distribute_module(model, mesh)
            din = {k: dt.distribute_tensor(v, mesh) for k, v in inputs.items()}
            compiled = torch.compile(model, backend=dtorch_backend, options={"worker_compiler": "inductor"})
            with cap:
                compiled(**din, return_dict=False)[0].full_tensor()
            dt.shutdown()
    return cap


def _pipeline_run(side: str, layers: tuple[int, int], args: argparse.Namespace) -> InductorCapture:
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ns = argparse.Namespace(
        model=args.model, tiny=args.tiny, layers=list(layers), text_tokens=args.text_tokens, steps=args.steps,
        size=args.size,
    )  # fmt: skip
    pipe = fg.build_pipeline(ns, device, dtype)
    kw = fg.call_kwargs(pipe, ns, device, dtype)
    cap = InductorCapture()
    if side == "inductor":
        pipe.transformer = torch.compile(pipe.transformer)
    else:
        import torch_dtorch as dt
        from torch_dtorch.apps.diffusion import ExecuteConfig, parallelize_pipeline

        mesh = dt.init_device_mesh(args.device, (1,), mesh_dim_names=("cp",))
        config = ExecuteConfig(cp_mode="ulysses", compile=True, worker_compiler="inductor")
        pipe = parallelize_pipeline(pipe, mesh, config)
    pipe.set_progress_bar_config(disable=True)
    with cap:
        pipe(**kw, generator=torch.Generator().manual_seed(0))
    if side != "inductor":
        import torch_dtorch as dt

        dt.shutdown()
    return cap


def compare(
    path: str, layers: tuple[int, int], args: argparse.Namespace
) -> tuple[dict[str, int], dict[str, int]]:
    """Run both sides of one setting; print and return their totals."""
    config = {
        **(cfg.TINY if args.tiny else cfg.FLUX_DEV),
        "num_layers": layers[0],
        "num_single_layers": layers[1],
    }
    caps = {}
    for side in ("inductor", "dtorch"):
        torch._dynamo.reset()
        caps[side] = (
            _transformer_run(side, config, args)
            if path == "transformer"
            else _pipeline_run(side, layers, args)
        )
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if args.dump:
            out = Path(args.dump)
            out.mkdir(parents=True, exist_ok=True)
            for i, g in enumerate(caps[side].graphs):
                name = f"{path}_{layers[0]}-{layers[1]}_{args.dtype}_{side}_{i}.py"
                (out / name).write_text(g.code)
    a, b = totals(caps["inductor"].graphs), totals(caps["dtorch"].graphs)
    blocks = (
        f"{layers[0]} joint blocks"
        if args.model == "sd3"
        else f"{layers[0]} double + {layers[1]} single blocks"
    )
    print(f"\n== {args.model} {path}, {blocks}, {args.dtype}, {args.device}"
          f" ({'tiny' if args.tiny else 'full'} widths) ==")  # fmt: skip
    print(side_by_side(a, b))
    diff = op_diff(caps["inductor"].graphs, caps["dtorch"].graphs)
    if diff:
        print("post-grad ops that differ (inductor, dtorch):")
        for op, (x, y) in diff.items():
            print(f"  {op}: {x} vs {y}")
    return a, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--model", choices=("flux", "sd3"), default="flux", help="sd3: the pipeline path only"
    )
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None, help="default: cpu float32, cuda bf16"
    )
    parser.add_argument(
        "--layers", type=int, nargs="+", default=[1, 1], metavar="N",
        help="pairs of (double, single) block counts: --layers 1 1 4 8",
    )  # fmt: skip
    parser.add_argument(
        "--path", nargs="+", choices=("transformer", "pipeline"), default=["transformer", "pipeline"]
    )
    parser.add_argument("--tiny", action="store_true", help="toy widths (the default on the CPU)")
    parser.add_argument(
        "--image-tokens", type=int, default=None, help="transformer path: default 4096 (cuda), 64"
    )
    parser.add_argument("--text-tokens", type=int, default=None, help="default 512 (cuda), 16")
    parser.add_argument(
        "--size", type=int, default=None, help="pipeline path: image side, default 1024 (cuda), 64"
    )
    parser.add_argument("--steps", type=int, default=1, help="pipeline path: denoising steps")
    parser.add_argument("--dump", default=None, metavar="DIR", help="write each side's generated code here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    # InductorCapture turns the caches off so every compile generates its code; dynamo says so at each compile
    warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")
    if len(args.layers) % 2:
        parser.error("--layers takes pairs: DOUBLE SINGLE [DOUBLE SINGLE ...]")
    if args.model == "sd3" and "transformer" in args.path:
        parser.error("--model sd3 compares the pipeline only: add --path pipeline")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("compile_parity: no CUDA device (torch.cuda.is_available() is False)")
    cpu = args.device == "cpu"
    args.tiny = args.tiny or cpu
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.image_tokens = args.image_tokens or (64 if args.tiny else 4096)
    args.text_tokens = args.text_tokens or (16 if args.tiny else 512)
    args.size = args.size or (64 if args.tiny else 1024)
    worse = []
    for i in range(0, len(args.layers), 2):
        layers = (args.layers[i], args.layers[i + 1])
        for path in args.path:
            a, b = compare(path, layers, args)
            for key in ("kernel launches", "copy-only kernel launches", "post-grad copies (clone/copy_/_to_copy)",
                        "buffers (empty_strided)", "extern calls", "inputs alignment-checked per call"):  # fmt: skip
                if b.get(key, 0) > a.get(key, 0):
                    worse.append(f"{path} {layers}: {key} {a.get(key, 0)} -> {b.get(key, 0)}")
    print(
        "\nparity:",
        "dtorch compiles no more kernels / copies than inductor" if not worse else "; ".join(worse),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
