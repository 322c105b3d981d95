"""Instructions a worker executes, in the order the controller issued them.

Data only (frozen dataclasses with slots): thread mode passes them as plain objects, process mode serializes them
(:mod:`torch_dtorch.cluster.codec`). Every worker receives every batch and runs the instructions that concern its device
(:func:`devices_of`). Tensor bytes never travel inside an instruction: they go through the TensorStore under
``(key, device)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_dtorch.graph import Operand, Operator

__all__ = [
    "Barrier",
    "FastRun",
    "Fetch",
    "Free",
    "Instruction",
    "Redistribute",
    "RunOp",
    "Upload",
    "devices_of",
]


@dataclass(frozen=True, slots=True)
class RunOp:
    """Run one operator (``node.payload`` is a ``BoundOp``) on each device of ``node.assign.devices``.

    ``call_site`` is the user's call site (``DTORCH_DEBUG=1`` only), quoted by the error if the kernel fails.
    ``replay_key``: an object shared by every call of this op on the same layout and constants (the fast path's plan,
    the codec's interned template): workers resolve the local call once per key and replay it
    (``runtime/replay.py``); ``None`` runs the general local path."""

    node: Operator
    call_site: str | None = None
    replay_key: Any = None


@dataclass(frozen=True, slots=True)
class Redistribute:
    """Run a redistribute operator (``node.payload`` is a ``RedistributePlan``) with real collectives."""

    node: Operator
    call_site: str | None = None


@dataclass(frozen=True, slots=True)
class Upload:
    """The controller put each device's shard of ``operand`` in the TensorStore under ``(key, device)``; every
    device of the operand's mesh takes its shard into a blob."""

    operand: Operand
    key: Any


@dataclass(frozen=True, slots=True)
class Fetch:
    """Each listed device puts a copy of its shard of ``operand`` (on the CPU) under ``(key, device)``, or the
    operand's sticky error."""

    operand: Operand
    key: Any
    devices: tuple[int, ...]


@dataclass(slots=True)
class Free:
    """Drop the blobs of these operands on every worker. The controller appends ids to the last pending ``Free``
    until the batch is flushed (the list is not changed after that)."""

    operand_ids: list[int]


@dataclass(frozen=True, slots=True)
class Barrier:
    """Every worker finishes everything before it (CUDA streams included), then puts a marker under
    ``(key, device)``."""

    key: Any


class FastRun:
    """An eager fast-path op in compact form: what the controller records per call when the op's plan is cached
    (``plan``: a :class:`~torch_dtorch.executor.fast.FastPlan`) — the call's arguments with operands in tensor
    positions, its tensor slots, its output operands, and the first operand and operator ids it takes (inputs it
    redistributes first get the ids before the outputs').

    Where it is executed (a worker) or encoded (process mode), :meth:`expand` turns it — once — into the
    ``Redistribute``/``RunOp``/``Free`` instructions it stands for, so the controller never builds them."""

    __slots__ = ("plan", "args", "inputs", "outputs", "first_id", "first_op", "call_site", "_expanded")

    def __init__(
        self,
        plan: Any,
        args: tuple[Any, ...] | None,
        inputs: list[Operand | None],
        outputs: list[Operand],
        first_id: int,
        first_op: int,
        call_site: str | None,
    ) -> None:
        self.plan = plan
        self.args = args
        self.inputs = inputs
        self.outputs = outputs
        self.first_id = first_id
        self.first_op = first_op
        self.call_site = call_site
        self._expanded: tuple[Instruction, ...] | None = None

    def expand(self) -> tuple[Instruction, ...]:
        """The instructions this stands for (built on first use; concurrent callers may both build equal ones)."""
        e = self._expanded
        if e is None:
            e = self._expanded = self.plan.expand(self)
        return e

    def __repr__(self) -> str:
        return f"FastRun({self.plan.op}, outputs={[o.name for o in self.outputs]})"


Instruction = RunOp | Redistribute | Upload | Fetch | Free | Barrier | FastRun


def devices_of(instr: Instruction) -> tuple[int, ...] | None:
    """Devices an instruction concerns; ``None`` means every worker."""
    if isinstance(instr, RunOp | Redistribute):
        assign = instr.node.assign
        return assign.devices if assign is not None else ()
    if isinstance(instr, Upload):
        mesh = instr.operand.mesh
        return tuple(mesh.devices) if mesh is not None else ()
    if isinstance(instr, Fetch):
        return instr.devices
    if isinstance(instr, FastRun):
        devices: set[int] = set()
        for i in instr.expand():
            d = devices_of(i)
            if d is None:
                return None
            devices.update(d)
        return tuple(sorted(devices))
    return None
