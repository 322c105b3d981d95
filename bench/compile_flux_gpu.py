"""One FLUX.1-dev-sized transformer step: ``torch.compile`` (inductor) vs ``backend="dtorch"`` on a 1-device mesh.

The model is diffusers' ``FluxTransformer2DModel`` with the public FLUX.1-dev configuration (19 double + 38 single
blocks, 24 heads x 128, joint_attention_dim 4096, pooled 768, guidance embeddings) and **random** bf16 weights created
directly on the GPU (nothing is downloaded). A 1024x1024 image is 4096 packed latent tokens (64 channels), the prompt
512 T5 tokens. Both are compiled first (two copies of the weights are held), then timed in ``--rounds`` alternating
rounds (warm-up, then ``--steps`` synchronized forward steps each; the order flips every round), and each is the
median of all its timed steps — a GPU whose clock drifts during the run (warming up, power limits) then affects both
alike:

- (a) ``torch.compile(model)`` — inductor on plain CUDA tensors;
- (b) ``torch.compile(model, backend="dtorch", options={"worker_compiler": "inductor"})`` on a 1-device CUDA mesh in
  thread mode: the same graph, captured with dtorch placements, compiled by inductor on the worker; each step is one
  ``RunProgram`` message. Target: (b) / (a) <= 1.02.

    python bench/compile_flux_gpu.py                      # full size, needs one large GPU (~24 GiB of weights)
    python bench/compile_flux_gpu.py --small              # 2 double + 2 single blocks: a quick check
    python bench/compile_flux_gpu.py --layers 10 10       # part of the model (compiles faster)
    python bench/compile_flux_gpu.py --small --device cpu # tiny widths on CPU: checks that the code path runs

Runs on torch 2.11+ with diffusers importable (``PYTHONPATH=...``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import logging
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("bench.compile_flux_gpu")

#: black-forest-labs/FLUX.1-dev transformer/config.json
FLUX_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
#: widths small enough for a CPU check (same structure)
TINY = {
    **FLUX_DEV,
    "in_channels": 16,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 16,
    "axes_dims_rope": (4, 6, 6),
}


def build_model(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer with random weights, created in ``dtype`` directly on ``device`` (no fp32 copy first)."""
    try:
        from diffusers import FluxTransformer2DModel
    except ImportError as e:
        sys.exit(
            f"compile_flux_gpu: diffusers is not importable ({e}); put it on PYTHONPATH or pip install it"
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = FluxTransformer2DModel(**config)
    finally:
        torch.set_default_dtype(previous)
    others = {str(p.dtype) for p in model.parameters() if p.dtype != dtype}
    if others:
        log.warning("parameters not created in %s: %s", dtype, sorted(others))
    return model.eval().requires_grad_(False)


def make_inputs(
    config: dict[str, Any], image_tokens: int, text_tokens: int, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """What the FLUX pipeline passes for one denoising step of a ``side x side`` latent grid."""
    g = torch.Generator(device="cpu").manual_seed(0)
    side = int(image_tokens**0.5)
    assert side * side == image_tokens, "image tokens must form a square grid"
    img_ids = torch.zeros(side, side, 3)
    img_ids[..., 1] = torch.arange(side)[:, None]
    img_ids[..., 2] = torch.arange(side)[None, :]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    return {
        "hidden_states": randn(1, image_tokens, config["in_channels"]),
        "encoder_hidden_states": randn(1, text_tokens, config["joint_attention_dim"]),
        "pooled_projections": randn(1, config["pooled_projection_dim"]),
        "timestep": torch.tensor([0.5], device=device, dtype=dtype),
        "guidance": torch.tensor([3.5], device=device, dtype=dtype),
        "img_ids": img_ids.reshape(image_tokens, 3).to(device=device, dtype=dtype),
        "txt_ids": torch.zeros(text_tokens, 3, device=device, dtype=dtype),
    }


def time_steps(
    step: Callable[[], Any], sync: Callable[[], None], warmup: int, steps: int
) -> tuple[list[float], Any]:
    """(seconds of each synchronized step, the last output) after ``warmup`` untimed steps."""
    out = None
    for _ in range(warmup):
        out = step()
        sync()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
    return times, out


def profile_steps(label: str, step: Callable[[], Any], sync: Callable[[], None], steps: int) -> None:
    """Profile ``steps`` synchronized steps: wall time, GPU kernel time and the top kernels (what separates the two
    compiles when their step times differ)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
            sync()
        wall = (time.perf_counter() - t0) / steps
    # the table's footer carries the total GPU kernel time ("Self CUDA time total") of the profiled steps
    log.info("%s profile: %d steps, %.2f ms wall/step", label, steps, wall * 1e3)
    log.info(
        "%s",
        prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70),
    )


def distribute_module(model: torch.nn.Module, mesh: Any) -> None:
    """Replace every parameter and buffer by a Replicate dtorch tensor on ``mesh`` (the plain copy is freed)."""
    import torch_dtorch as dt

    for name, p in list(model.named_parameters()):
        owner, leaf = _owner(model, name)
        setattr(owner, leaf, torch.nn.Parameter(dt.distribute_tensor(p.detach(), mesh), requires_grad=False))
        del p
    for name, b in list(model.named_buffers()):
        owner, leaf = _owner(model, name)
        owner.register_buffer(leaf, dt.distribute_tensor(b, mesh))


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    if "." not in name:
        return model, name
    path, leaf = name.rsplit(".", 1)
    return model.get_submodule(path), leaf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 double + 2 single blocks")
    parser.add_argument(
        "--layers", type=int, nargs=2, metavar=("DOUBLE", "SINGLE"), help="block counts (default 19 38)"
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of (a) then (b), alternating which goes first"
    )
    parser.add_argument("--image-tokens", type=int, default=None, help="default 4096 (1024x1024); 64 on CPU")
    parser.add_argument("--text-tokens", type=int, default=None, help="default 512; 16 on CPU")
    parser.add_argument("--worker-compiler", default="inductor", choices=["inductor", "eager"])
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile N steps of each and print the top kernels",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "compile_flux_gpu: no CUDA device is available (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}); run it on a GPU machine, or check the code path with --small --device cpu"
        )
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    config = dict(TINY if cpu else FLUX_DEV)
    if args.small:
        config.update(num_layers=2, num_single_layers=2)
    if args.layers:
        config.update(num_layers=args.layers[0], num_single_layers=args.layers[1])
    dtype = torch.float32 if cpu else torch.bfloat16
    image_tokens = args.image_tokens or (64 if cpu else 4096)
    text_tokens = args.text_tokens or (16 if cpu else 512)
    if cpu:
        torch.set_num_threads(max(1, torch.get_num_threads()))
    sync = torch.cuda.synchronize if not cpu else (lambda: None)

    import torch_dtorch as dt
    from torch_dtorch.backend import dtorch_backend

    log.info(
        "FLUX transformer: %d double + %d single blocks, %d heads x %d, %s on %s; %d image + %d text tokens; "
        "torch %s",
        config["num_layers"], config["num_single_layers"], config["num_attention_heads"],
        config["attention_head_dim"], str(dtype).removeprefix("torch."), device, image_tokens, text_tokens,
        torch.__version__,
    )  # fmt: skip
    model = build_model(config, device, dtype)
    log.info("parameters: %.2f B", sum(p.numel() for p in model.parameters()) / 1e9)
    inputs = make_inputs(config, image_tokens, text_tokens, device, dtype)

    # (a) inductor on plain tensors
    with torch.no_grad():
        t0 = time.perf_counter()
        compiled_a = torch.compile(model)
        compiled_a(**inputs, return_dict=False)
        sync()
        log.info("(a) inductor: first call (compile) %.1f s", time.perf_counter() - t0)

    # (b) dtorch on a 1-device mesh (thread mode), inductor on the worker, on a copy of the same weights (both are
    # kept so that the two are timed alternately: a GPU warming up or throttling during a run affects both equally)
    mesh = dt.init_device_mesh(args.device, (1,), mode="thread")
    model_b = copy.deepcopy(model)
    distribute_module(model_b, mesh)  # the copy's plain weights are dropped as their dtorch copies are made
    gc.collect()
    if not cpu:
        torch.cuda.empty_cache()
    din = {k: dt.distribute_tensor(v, mesh) for k, v in inputs.items()}
    reports: list[Any] = []
    with torch.no_grad():
        t0 = time.perf_counter()
        # the backend function itself: works with PYTHONPATH alone (no installed entry point)
        compiled_b = torch.compile(
            model_b,
            backend=dtorch_backend,
            options={"worker_compiler": args.worker_compiler, "reports": reports},
        )
        compiled_b(**din, return_dict=False)[0]
        dt.sync()
        sync()
        log.info(
            "(b) dtorch: first call (capture, propagation, worker compile) %.1f s", time.perf_counter() - t0
        )

        def dsync() -> None:
            dt.sync()
            sync()

        def step_a() -> Any:
            return compiled_a(**inputs, return_dict=False)[0]

        def step_b() -> Any:
            return compiled_b(**din, return_dict=False)[0]

        times_a: list[float] = []
        times_b: list[float] = []
        ref = out = None
        for r in range(args.rounds):
            # alternate which goes first, so neither always follows the other
            order = [(step_a, sync, times_a), (step_b, dsync, times_b)]
            for step, sync_fn, times in order if r % 2 == 0 else order[::-1]:
                result = time_steps(step, sync_fn, args.warmup, args.steps)
                times.extend(result[0])
                log.info(
                    "round %d %s: median %.2f ms", r, "(a)" if step is step_a else "(b)",
                    statistics.median(result[0]) * 1e3,
                )  # fmt: skip
                if step is step_a:
                    ref = result[1]
                else:
                    out = result[1]
        t_inductor = statistics.median(times_a)
        t_dtorch = statistics.median(times_b)
        if args.profile:
            profile_steps("(a) inductor", step_a, sync, args.profile)
            profile_steps("(b) dtorch", step_b, dsync, args.profile)
        assert ref is not None and out is not None
        ref = ref.float().cpu()
        out = out.full_tensor().float().cpu()
    errors = [r.error for r in reports if r.error]
    log.info("(b) compiled graphs: %d%s", len(reports), f"; NOT compiled: {errors}" if errors else "")
    diff = (out - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0
    log.info(
        "max |dtorch - inductor| = %.3g (relative to max |output| %.3g: %.2e)", diff, scale, diff / scale
    )

    ratio = t_dtorch / t_inductor
    log.info("%-40s %10.2f ms", "(a) torch.compile (inductor)", t_inductor * 1e3)
    log.info("%-40s %10.2f ms", f"(b) backend=dtorch, worker {args.worker_compiler}", t_dtorch * 1e3)
    log.info("ratio (b)/(a) = %.3f  (target <= 1.02: %s)", ratio, "met" if ratio <= 1.02 else "NOT met")
    dt.shutdown()


if __name__ == "__main__":
    main()
