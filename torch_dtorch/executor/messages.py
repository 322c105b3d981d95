"""Instructions a worker executes, in the order the controller issued them.

Data only (frozen dataclasses with slots): thread mode passes them as plain objects, process mode will serialize
them (later issue). Every worker receives every batch and runs the instructions that concern its device
(:func:`devices_of`). Tensor bytes never travel inside an instruction: they go through the TensorStore under
``(key, device)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch_dtorch.graph import Operand, Operator

__all__ = [
    "Barrier",
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

    ``call_site`` is the user's call site (``DTORCH_DEBUG=1`` only), quoted by the error if the kernel fails."""

    node: Operator
    call_site: str | None = None


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


@dataclass(frozen=True, slots=True)
class Free:
    """Drop the blobs of these operands on every worker. The controller appends ids to the last pending ``Free``
    until the batch is flushed (the list is not changed after that)."""

    operand_ids: list[int]


@dataclass(frozen=True, slots=True)
class Barrier:
    """Every worker finishes everything before it (CUDA streams included), then puts a marker under
    ``(key, device)``."""

    key: Any


Instruction = RunOp | Redistribute | Upload | Fetch | Free | Barrier


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
    return None
