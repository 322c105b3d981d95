"""Command-line pieces the applications share (``dtorch diffuse``, ``dtorch llama``): the ``--mesh`` syntax and the
flags that say where the workers run."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["add_mesh_arguments", "mesh_parser"]


def mesh_parser(*, axes: Sequence[str] | None, all_ones: str | None) -> Callable[[str], dict[str, int]]:
    """A ``--mesh`` parser: ``"NAME=SIZE,..."`` -> ``{name: size}`` with the axes of size 1 dropped (order kept).
    ``axes``: the names allowed (``None``: any; the application checks them). When every axis is 1 the mesh is
    ``{all_ones: 1}`` (``None``: the first axis given, else ``"cp"``)."""

    def parse(text: str) -> dict[str, int]:
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, size = (s.strip() for s in part.partition("="))
            if not sep or not size.isdigit() or int(size) < 1:
                raise argparse.ArgumentTypeError(
                    f"--mesh: expected NAME=SIZE[,NAME=SIZE...], got {part!r} in {text!r}"
                )
            if axes is not None and name not in axes:
                raise argparse.ArgumentTypeError(f"--mesh: unknown axis {name!r}; use {', '.join(axes)}")
            if name in sizes:
                raise argparse.ArgumentTypeError(f"--mesh: axis {name!r} given twice in {text!r}")
            sizes[name] = int(size)
        kept = {k: v for k, v in sizes.items() if v > 1}
        return kept or {all_ones if all_ones is not None else next(iter(sizes), "cp"): 1}

    return parse


def add_mesh_arguments(
    p: Any, *, parse: Callable[[str], dict[str, int]], default: str, mesh_help: str, compile_help: str
) -> None:
    """``--mesh``, ``--cp-mode``, ``--mode``, ``--device``, ``--simulate`` and ``--compile`` on parser ``p``."""
    p.add_argument("--mesh", type=parse, default=parse(default), help=mesh_help)
    p.add_argument("--cp-mode", choices=("ulysses", "ring", "both"), default="ulysses")
    p.add_argument(
        "--mode", choices=("thread", "process"), default="thread", help="worker threads or processes"
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--simulate", action="store_true", help="CUDA: every rank on one GPU")
    p.add_argument("--compile", action="store_true", help=compile_help)
