"""One line per operator, with placements: the form golden tests compare.

    %0 = input() -> f32[8, 16] S(0)R
    %2 = aten.mm(%0: S(0)R, %1: RS(1)) -> f32[8, 32] S(0)S(1)
    %3 = redistribute(%2: S(0)S(1)) -> f32[8, 32] RS(1)  # all_gather(axis=0, dim=0)

Operands on a mesh other than the first one the graph uses carry ``@m1``, ``@m2``... and the meshes are listed in a
header.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torch_dtorch.graph.graph import LogicalGraph
from torch_dtorch.graph.operand import Operand, dtype_str
from torch_dtorch.graph.operator import Operator
from torch_dtorch.mesh import DeviceMesh

__all__ = ["format_graph", "format_operator", "format_arg"]


class _MeshNames:
    def __init__(self) -> None:
        self.meshes: list[DeviceMesh] = []

    def tag(self, mesh: DeviceMesh | None) -> str:
        if mesh is None:
            return ""
        for i, m in enumerate(self.meshes):
            if m == mesh:
                return "" if i == 0 else f"@m{i}"
        self.meshes.append(mesh)
        return "" if len(self.meshes) == 1 else f"@m{len(self.meshes) - 1}"


def format_arg(a: Any, names: _MeshNames | None = None) -> str:
    if isinstance(a, Operand):
        tag = names.tag(a.mesh) if names is not None else ""
        return f"{a.name}: {a.placements_str}{tag}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(format_arg(x, names) for x in a)
        return f"[{inner}]"
    if isinstance(a, torch.dtype):
        return dtype_str(a)
    if isinstance(a, float):
        return repr(a)
    if isinstance(a, torch.device):
        return f"'{a}'"
    if isinstance(a, str):
        return repr(a)
    return str(a)


def _format_out(o: Operand, names: _MeshNames) -> str:
    return f"{o.type_str()} {o.placements_str}{names.tag(o.mesh)}"


def format_operator(node: Operator, names: _MeshNames | None = None) -> str:
    names = names or _MeshNames()
    outs = ", ".join(o.name for o in node.outputs) or "_"
    parts = [format_arg(a, names) for a in node.args]
    parts += [f"{k}={format_arg(v, names)}" for k, v in node.kwargs.items()]
    results = ", ".join(_format_out(o, names) for o in node.outputs)
    if len(node.outputs) > 1:
        results = f"({results})"
    line = f"{outs} = {node.name}({', '.join(parts)}) -> {results}"
    if node.note:
        line += f"  # {node.note}"
    return line


def _format_input(o: Operand, names: _MeshNames) -> str:
    tag = f"  # {o.tag}" if o.tag else ""
    return f"{o.name} = input() -> {_format_out(o, names)}{tag}"


def format_graph(graph: LogicalGraph, *, show_inputs: bool = True) -> str:
    names = _MeshNames()
    lines: list[str] = []
    if show_inputs:
        used = {i.id for node in graph.operators for i in node.inputs if i is not None}
        lines += [_format_input(o, names) for o in graph.inputs() if o.id in used]
    lines += [format_operator(node, names) for node in graph.operators]
    if len(names.meshes) > 1:
        header = [f"# m{i}: {m!r}" for i, m in enumerate(names.meshes)]
        lines = header + lines
    return "\n".join(lines)


def format_operands(operands: Sequence[Operand]) -> list[str]:
    return [o.describe() for o in operands]
