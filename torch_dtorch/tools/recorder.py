"""``GraphRecorder``: keep the operators the eager executor records while it is active, as a printable
:class:`~torch_dtorch.graph.LogicalGraph`.

The eager executor keeps no history (``LogicalGraph(record=False)``); a recorder is a listener on its
:class:`~torch_dtorch.executor.constructor.GraphConstructor`, so every operator (redistributes included) is seen in
issue order. With ``fetch=True`` it also requests the global value of every operand the recorded operators read or
write, *at the moment the operator is recorded* (before a later op or a ``Free`` can change or drop it): that is what
the op-level mismatch localizer replays against torch. Fetching is a flush per operator: a debugging tool only.

While a recorder is active every op takes the executor's general path (the inline fast path only serves a lone
listener), so timings measured under it are not representative.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.graph import LogicalGraph, Operand, Operator

__all__ = ["GraphRecorder", "RecordedOp"]

log = logging.getLogger(__name__)


@dataclass
class RecordedOp:
    """One recorded operator and (with ``fetch=True``) futures of its inputs' and outputs' global values."""

    node: Operator
    inputs: list[TensorFuture | None] = field(default_factory=list)
    outputs: list[TensorFuture | None] = field(default_factory=list)


class GraphRecorder:
    """Context manager recording every operator of ``executor`` (default: the running dtorch runtime's).

    Attributes:
        graph: the recorded operators as a :class:`LogicalGraph` (``str(recorder.graph)`` prints them).
        ops: the :class:`RecordedOp` of each operator, in issue order.
    """

    def __init__(self, executor: Any = None, *, fetch: bool = False) -> None:
        if executor is None:
            from torch_dtorch.device.state import get_session

            executor = get_session().executor
        self.executor = executor
        self.fetch = fetch
        self.graph = LogicalGraph()
        self.ops: list[RecordedOp] = []
        #: latest future of each operand's value (an in-place op replaces it)
        self._latest: dict[int, TensorFuture | None] = {}

    def __enter__(self) -> GraphRecorder:
        self.executor.constructor.listeners.append(self._on_operator)
        return self

    def __exit__(self, *exc: Any) -> None:
        listeners = self.executor.constructor.listeners
        if self._on_operator in listeners:
            listeners.remove(self._on_operator)

    def format(self) -> str:
        """The recorded operators one per line (``%3 = aten.mm(%1: S(0)R, %2: RS(1)) -> f32[8, 32] S(0)S(1)``),
        preceded by the operands they read that were produced before recording started."""
        from torch_dtorch.graph.printer import _format_input, _MeshNames, format_operator

        names = _MeshNames()
        produced = {o.id for node in self.graph.operators for o in node.outputs}
        seen: set[int] = set()
        lines = []
        for node in self.graph.operators:
            for x in node.inputs:
                if x is not None and x.id not in produced and x.id not in seen:
                    seen.add(x.id)
                    lines.append(_format_input(x, names))
        lines += [format_operator(node, names) for node in self.graph.operators]
        return "\n".join(lines)

    def _on_operator(self, node: Operator) -> None:
        g = self.graph
        for o in [*node.inputs, *node.outputs]:
            if o is not None and o.id not in g.operands:
                g.operands[o.id] = o
        g.operators.append(node)
        rec = RecordedOp(node)
        if self.fetch:
            rec.inputs = [self._value(x) if x is not None else None for x in node.inputs]
            rec.outputs = [self._fetch(o) for o in node.outputs]
            for o, fut in zip(node.outputs, rec.outputs, strict=True):
                self._latest[o.id] = fut
        self.ops.append(rec)

    def _value(self, x: Operand) -> TensorFuture | None:
        if x.id not in self._latest:
            self._latest[x.id] = self._fetch(x)
        return self._latest[x.id]

    def _fetch(self, x: Operand) -> TensorFuture | None:
        if x.mesh is None:
            return None  # an unbound operand has no data on the workers yet
        try:
            fut: TensorFuture = self.executor.fetch(x)
            return fut
        except Exception as e:  # noqa: BLE001 - a value we cannot fetch is reported as unknown
            log.debug("GraphRecorder: cannot fetch %s: %s", x.name, e)
            return None
