"""Regenerate the committed gRPC stubs ``heartbeat_pb2.py`` / ``heartbeat_pb2_grpc.py`` from ``heartbeat.proto``.

Run from the repository root with grpcio-tools installed (a dev-only tool, not a runtime dependency)::

    python -m torch_dtorch.cluster.heartbeat.regen_stubs

The generated files carry two version guards that would tie them to the exact toolchain that made them: the
protobuf gencode check (``ValidateProtobufRuntimeVersion``: refuses a runtime older than the generator's
protobuf) and the grpc one (``GRPC_GENERATED_VERSION``: refuses a grpcio older than grpcio-tools). Machines
of this project run different grpcio (1.84 vs 1.85) and protobuf releases, so both guards are removed here; the
stubs only use APIs present in grpcio >= 1.62 and protobuf >= 5.27 (builder + ``AddSerializedFile``).
The module ``tests/cluster/heartbeat/test_stubs.py`` checks that the stubs import and round-trip a message.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PROTO = HERE / "heartbeat.proto"
HEADER = "# ruff: noqa\n# mypy: ignore-errors\n# Generated from heartbeat.proto by regen_stubs.py (version guards removed, see there).\n"


def _strip_pb2(text: str) -> str:
    text = re.sub(
        r"_runtime_version\.ValidateProtobufRuntimeVersion\(.*?\n\)\n",
        "# (protobuf runtime-version check removed by regen_stubs.py)\n",
        text,
        flags=re.S,
    )
    text = text.replace("from google.protobuf import runtime_version as _runtime_version\n", "")
    return HEADER + text


def _strip_pb2_grpc(text: str) -> str:
    text = re.sub(
        r"GRPC_GENERATED_VERSION = .*?\n    \)\n",
        "# (grpcio version guard removed by regen_stubs.py: these stubs load on grpcio >= 1.62)\n",
        text,
        flags=re.S,
    )
    text = text.replace("import warnings\n", "")
    return HEADER + text


def main() -> int:
    rel = PROTO.relative_to(ROOT)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I.",
        "--python_out=.",
        "--grpc_python_out=.",
        "--pyi_out=.",
        str(rel),
    ]
    subprocess.run(cmd, cwd=ROOT, check=True)
    fixes = (
        ("heartbeat_pb2.py", _strip_pb2),
        ("heartbeat_pb2_grpc.py", _strip_pb2_grpc),
        ("heartbeat_pb2.pyi", lambda text: HEADER + text),
    )
    for name, fix in fixes:
        path = HERE / name
        path.write_text(fix(path.read_text()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
