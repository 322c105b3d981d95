"""The ``dtorch`` command line (console script ``dtorch = torch_dtorch.cli:main``).

Sub-commands import what they need lazily, so ``dtorch version`` and ``dtorch --help`` stay fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import platform
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

_LOG_LEVEL_ENV = "DTORCH_LOG_LEVEL"

#: modules of the applications' sub-commands, each with ``add_parser(sub)``
_APP_CLI_MODULES: tuple[str, ...] = ("torch_dtorch.apps.diffusion.cli", "torch_dtorch.apps.llama.cli")


def _dist_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cmd_version(args: argparse.Namespace) -> int:
    print(
        f"torch-dtorch {_dist_version('torch-dtorch')} "
        f"(torch {_dist_version('torch')}, python {platform.python_version()})"
    )
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    # Contract with torch_dtorch/apps/demo.py: ``main(argv: list[str] | None = None) -> int | None``.
    # Arguments after ``dtorch demo`` are passed through unparsed (``dtorch demo -- --help`` for the demo's help).
    demo = importlib.import_module("torch_dtorch.apps.demo")
    demo_main: Callable[[list[str] | None], int | None] = demo.main
    rc = demo_main(list(args.passthrough))
    return 0 if rc is None else int(rc)


def _cmd_worker(args: argparse.Namespace) -> int:
    # Contract with torch_dtorch/cluster/worker/cli.py: ``serve(...) -> int`` (one worker process per device).
    from torch_dtorch.cluster.worker.cli import serve

    return serve(
        controller=args.controller,
        secret_file=args.secret_file,
        devices=args.devices,
        host=args.host,
        local_indices=args.local_indices,
        start_timeout_s=args.start_timeout,
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dtorch",
        description="torch-dtorch: one controller process drives N devices as one.",
        epilog=f"Set {_LOG_LEVEL_ENV}=DEBUG|INFO|WARNING|ERROR for logging (default WARNING).",
    )
    parser.set_defaults(passthrough_ok=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p_demo = sub.add_parser(
        "demo",
        help="run the built-in demo on a simulated CPU mesh",
        description="Run the built-in demo; further arguments are passed to the demo unparsed.",
    )
    p_demo.set_defaults(func=_cmd_demo, passthrough_ok=True)

    p_worker = sub.add_parser(
        "worker",
        help="serve devices of a controller on another host (cluster mode)",
        description="Start one dtorch worker process per device and join the controller at --controller. "
        "The controller runs init_device_mesh(..., mode='process') with DTORCH_CLUSTER_LISTEN=tcp://HOST:PORT, "
        "DTORCH_CLUSTER_SECRET_FILE and DTORCH_CLUSTER_LOCAL_DEVICES naming the devices it starts itself.",
    )
    p_worker.add_argument(
        "--controller", required=True, help="the controller's control endpoint, tcp://HOST:PORT"
    )
    p_worker.add_argument("--secret-file", required=True, help="file (mode 0600) holding the cluster secret")
    p_worker.add_argument(
        "--devices", required=True, help="device ids (mesh ranks) served here, e.g. 2,3 or 4-7"
    )
    p_worker.add_argument("--host", default=None, help="this host's address to connect from (default: any)")
    p_worker.add_argument(
        "--local-indices", default=None, help="CUDA device index of each served device (default: 0, 1, ...)"
    )
    p_worker.add_argument(
        "--start-timeout", type=float, default=120.0, help="seconds to wait for the controller"
    )
    p_worker.set_defaults(func=_cmd_worker)

    # ``debug-mismatch`` and ``roofline`` (torch_dtorch/tools/commands.py; imported when the parser is built, the
    # heavy imports happen inside the commands)
    from torch_dtorch.tools.commands import add_parsers as _add_tool_parsers

    _add_tool_parsers(sub)

    # the applications' sub-commands (``dtorch diffuse``, ``dtorch llama``): each app's ``cli.py`` has
    # ``add_parser(sub) -> None`` and imports its heavy dependencies inside the command
    for name in _APP_CLI_MODULES:
        importlib.import_module(name).add_parser(sub)

    p_version = sub.add_parser("version", help="print torch-dtorch, torch and python versions")
    p_version.set_defaults(func=_cmd_version)
    return parser


def _setup_logging() -> None:
    name = os.environ.get(_LOG_LEVEL_ENV, "WARNING").strip().upper() or "WARNING"
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        print(f"dtorch: ignoring unknown {_LOG_LEVEL_ENV}={name!r}; using WARNING", file=sys.stderr)
        level = logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dtorch`` console script; returns the process exit code."""
    _setup_logging()
    parser = _build_parser()
    args, extra = parser.parse_known_args(list(argv) if argv is not None else None)
    if extra and not args.passthrough_ok:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.passthrough = extra[1:] if extra[:1] == ["--"] else extra
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
