"""Where a compiled backward's gradients end: in the layout of the forward input each belongs to.

aot_autograd's backward graph returns one gradient per forward input (``None`` where none is needed), in the forward
inputs' order. Propagated alone it would leave a gradient wherever its last op put it — ``Partial`` for a replicated
weight used on a batch sharded over ``dp`` — and the eager hooks of :func:`torch_dtorch.match_grad_placements` would
then move it op by op. :class:`GradPlacements` links the two graphs of one compiled region: the forward graph records
which compiled variant (input layouts) each call ran, and the backward graph, when it compiles a variant, asks for
those layouts and propagates with them as **output targets**, so every gradient leaves the backward program in its
input's placements (a ``Partial`` is reduced — all-reduced, or reduce-scattered for a sharded parameter — inside
the program, with the other collectives). Targets only choose where a value lands, never its value: a backward run
for an older forward of another layout is still exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch_dtorch.backend.place import place_as_target
from torch_dtorch.graph import Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Placements

__all__ = ["GradPlacements", "OutTarget", "place_output"]

#: the root mesh and root placements one graph output must end in
OutTarget = tuple[DeviceMesh, Placements]


class GradPlacements:
    """The forward graph's last variant, read by its backward graph (see the module docstring)."""

    __slots__ = ("_inputs", "num_inputs")

    def __init__(self) -> None:
        self._inputs: Sequence[Operand] | None = None
        self.num_inputs = 0

    def record(self, inputs: Sequence[Operand], num_inputs: int) -> None:
        """Called by the forward graph on every call (cheap: the variant's propagated input operands)."""
        self._inputs = inputs
        self.num_inputs = num_inputs

    def targets(self, num_outputs: int) -> tuple[OutTarget | None, ...] | None:
        """Per backward output, the layout of its forward input (``None``: no forward call seen yet, or the counts
        differ — a graph whose gradients do not map one to one onto its inputs keeps its propagated placements)."""
        inputs = self._inputs
        if inputs is None or self.num_inputs != num_outputs:
            return None
        return tuple(
            (x.mesh.root, tuple(x.root_placements)) if x.mesh is not None else None
            for x in inputs[: self.num_inputs]
        )


def place_output(con: Any, y: Any, target: OutTarget | None) -> Any:
    """``y`` redistributed to ``target`` (a ``Partial`` in the target becomes ``Replicate``) by the propagating
    :class:`~torch_dtorch.executor.constructor.GraphConstructor` ``con``; anything else unchanged."""
    if target is None or not isinstance(y, Operand) or y.mesh is None:
        return y
    mesh, placements = target
    tgt = place_as_target(y.mesh, y.root_placements, mesh, placements)
    return y if tgt is None else con.redistribute(y, tgt[1], device_mesh=tgt[0])
