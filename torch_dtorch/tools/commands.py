"""``dtorch debug-mismatch`` and ``dtorch roofline``: the debugging tools on the built-in tiny demo model
(:mod:`torch_dtorch.tools.demo`). CLI output is printed; everything else logs."""

from __future__ import annotations

import argparse

import torch

__all__ = ["add_parsers", "debug_mismatch", "roofline_command"]


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "debug-mismatch",
        help="localize where a dtorch model's outputs start to differ from torch (tiny demo model)",
        description="Run the built-in TinyNet tensor-parallel on a simulated CPU mesh and its torch twin, and name "
        "the first module, then the first operator, whose outputs differ. --plant makes one activation's local "
        "kernel wrong on one worker, to see the localizer at work.",
    )
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (simulated CPU devices)")
    p.add_argument(
        "--acts", default="relu,gelu,silu", help="activation of each block (relu, gelu, silu, tanh)"
    )
    p.add_argument("--plant", default=None, help="activation whose kernel is made wrong on the last worker")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-5)
    p.set_defaults(func=debug_mismatch)

    r = sub.add_parser(
        "roofline",
        help="roofline report of the tiny demo model (per-operator FLOPs, bytes, estimated time)",
        description="Record the operators of one forward pass of the built-in TinyNet and estimate each under the "
        "roofline model of a device (table peaks for A100/H100/H200, or a measured CPU probe).",
    )
    r.add_argument("--tp", type=int, default=2)
    r.add_argument("--batch", type=int, default=4)
    r.add_argument("--seq", type=int, default=64)
    r.add_argument("--dim", type=int, default=64)
    r.add_argument("--device", default="cpu", help="peaks of: cpu (measured), H100, H200, A100, or cuda")
    r.add_argument("--top", type=int, default=10, help="rows of the table")
    r.add_argument("--png", default=None, help="write a roofline plot here (needs matplotlib)")
    r.set_defaults(func=roofline_command)


def debug_mismatch(args: argparse.Namespace) -> int:
    import torch_dtorch as dt
    from torch_dtorch.tools.demo import ACTIVATIONS, build_demo, plant_fault
    from torch_dtorch.tools.localizer import localize_mismatch

    acts = [a.strip() for a in args.acts.split(",") if a.strip()]
    unknown = [a for a in [*acts, args.plant] if a is not None and a not in ACTIVATIONS]
    if unknown:
        print(f"dtorch debug-mismatch: unknown activation(s) {unknown}; choose from {sorted(ACTIVATIONS)}")
        return 2
    try:
        model, twin, mesh = build_demo(tp=args.tp, acts=acts)
        x = torch.randn(2, 8, 16)
        if args.plant is not None:
            with plant_fault(ACTIVATIONS[args.plant][1], device=args.tp - 1):
                report = localize_mismatch(model, twin, (x,), mesh=mesh, rtol=args.rtol, atol=args.atol)
        else:
            report = localize_mismatch(model, twin, (x,), mesh=mesh, rtol=args.rtol, atol=args.atol)
        print(report)
        return 0 if report.ok else 1
    finally:
        dt.shutdown()


def roofline_command(args: argparse.Namespace) -> int:
    import torch_dtorch as dt
    from torch_dtorch.tools.demo import build_demo
    from torch_dtorch.tools.recorder import GraphRecorder
    from torch_dtorch.tools.roofline import GPU_TABLE, device_peaks, roofline

    peaks = GPU_TABLE.get(args.device.upper()) or device_peaks(args.device)
    try:
        model, _, mesh = build_demo(tp=args.tp, dim=args.dim, hidden=4 * args.dim)
        x = dt.distribute_tensor(torch.randn(args.batch, args.seq, args.dim), mesh)
        with GraphRecorder() as rec, torch.no_grad():
            model(x).full_tensor()
        report = roofline(rec.graph, peaks=peaks)
        print(report.table(args.top))
        if args.png:
            print(f"wrote {report.save_png(args.png)}")
        return 0
    finally:
        dt.shutdown()
