"""``CompileReport``: the three graphs of one compiled variant, as golden tests and ``dtorch_debug`` show them."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompileReport"]


@dataclass
class CompileReport:
    """(a) the captured aten graph, (b) the LogicalGraph with placements, (c) each rank's local program.

    ``inputs`` describes the input layouts the variant was compiled for (one line per graph input); ``error`` is
    set when placement propagation failed or was skipped (the graph then runs eagerly)."""

    aten: str
    logical: str = ""
    local: dict[int, str] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    error: str | None = None

    def __str__(self) -> str:
        parts = ["== captured aten graph ==", self.aten]
        if self.inputs:
            parts += ["== input layouts ==", *self.inputs]
        if self.error is not None:
            parts += ["== placement propagation ==", f"not compiled: {self.error}"]
        if self.logical:
            parts += ["== LogicalGraph ==", self.logical]
        for device, text in sorted(self.local.items()):
            parts += [f"== local program of device {device} ==", text]
        return "\n".join(parts) + "\n"
