"""``OpRunner``: runs one operator on one device.

A kernel fetches the operator's local input blobs, computes — the rule's local kernel exactly as
:func:`~torch_dtorch.placement_rules.ranks.run_rank` runs it (:func:`~torch_dtorch.runtime.local.run_rank`) for ops, the collectives of a plan through
:func:`~torch_dtorch.collectives.redistribute.execute_plan` for redistributes — and stores the output blobs.

Errors are sticky (the protocol of ``runtime/sticky.py``, shared with the compiled backend's programs): an exception
poisons the outputs with a :class:`KernelError`; an operator with a poisoned input poisons its outputs without
running. A redistribute or communicating kernel still takes part in its collectives with zeros of the right local
shape (so peers never hang), then poisons its output; through the runner's poison board every rank that received
data from a poisoned rank poisons its output too, so no replica silently holds zeros.

``DTORCH_VALIDATE_KERNEL_IO=1`` checks every local output's shape, dtype and device against the operand's inferred
metadata and raises :class:`KernelIOError` (sticky like any kernel error).

``before_hooks`` / ``after_hooks`` are called with ``(instruction, device)`` around every operator (tests use them to
slow workers down or to count; the trace exporter will use them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from torch_dtorch.graph import Operand, Operator
from torch_dtorch.graph.operator import op_name
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement_rules.call import LocalContext
from torch_dtorch.placement_rules.ranks import local_context
from torch_dtorch.runtime.blob import Blob, KernelError
from torch_dtorch.runtime.local import kernel_needs_comm, local_shape, run_rank
from torch_dtorch.runtime.replay import LocalCall
from torch_dtorch.runtime.sticky import PoisonBoard, StickyCall, call_hooks, kernel_error, poison
from torch_dtorch.runtime.stream import COMM, COMPUTE, KernelStream

__all__ = ["OpRunner", "KernelIOError", "after_hooks", "before_hooks", "kernel_hooks"]

log = logging.getLogger(__name__)

Hook = Callable[[Any, int], None]
#: called with ``(instruction, device)`` before / after every operator a kernel runs (or poisons)
before_hooks: list[Hook] = []
after_hooks: list[Hook] = []


def kernel_hooks() -> bool:
    """Whether any kernel hook is installed (tests, ``dt.profile``): replayed ops then take the general path, which
    calls them."""
    return bool(before_hooks or after_hooks)


class KernelIOError(KernelError):
    """A local kernel produced an output whose shape, dtype or device differs from the inferred metadata
    (raised with ``DTORCH_VALIDATE_KERNEL_IO=1``, and always for a redistribute input of the wrong shape)."""


class _MeshInfo:
    __slots__ = ("coord", "shape", "devices")

    def __init__(self, root: DeviceMesh, device: int) -> None:
        self.devices = frozenset(root.devices)
        self.shape = root.shape
        self.coord = root.coordinate_of(device) if device in self.devices else None


class OpRunner:
    """Runs operators for one device over its blob table.

    Args:
        device: this worker's device id (its rank in every mesh).
        torch_device: where its tensors live.
        blobs: the worker's blob table (operand id -> :class:`Blob`), read and written in place.
        stream: the worker's :class:`KernelStream` (CUDA streams and events).
        comm: the worker's communicator, passed to ``execute_plan``.
        validate: check every output against the inferred metadata (``DTORCH_VALIDATE_KERNEL_IO``).
        board: shared :class:`PoisonBoard` (thread mode), or ``None``.
        host_sync_collectives: on CUDA, make redistributes host-synchronous (needed by in-memory collectives);
            ``None`` (default): unless the communicator is stream-ordered (``comm.stream_ordered``: its collectives run
            in the order of the calling stream, as ``torch.distributed`` backends do).
    """

    def __init__(
        self,
        device: int,
        torch_device: torch.device,
        blobs: MutableMapping[int, Blob],
        stream: KernelStream | None,
        comm: Any,
        *,
        validate: bool = False,
        board: PoisonBoard | None = None,
        host_sync_collectives: bool | None = None,
    ) -> None:
        self.device = device
        self.torch_device = torch_device
        self.blobs = blobs
        self.stream = stream
        self.comm = comm
        self.validate = validate
        self.board = board
        #: CUDA with in-memory collectives: a collective's results are computed by whichever rank's thread arrives
        #: last, on its own stream, so a redistribute waits for its input on the host and for the device after.
        self.host_sync_collectives = (
            not getattr(comm, "stream_ordered", False)
            if host_sync_collectives is None
            else host_sync_collectives
        )
        self._meshes: dict[DeviceMesh, _MeshInfo] = {}
        self._execute_plan: Callable[..., torch.Tensor | None] | None = None

    @property
    def execute_plan(self) -> Callable[..., torch.Tensor | None]:
        """``collectives.redistribute.execute_plan`` (imported on first use)."""
        if self._execute_plan is None:
            from torch_dtorch.collectives.redistribute import execute_plan

            self._execute_plan = execute_plan
        return self._execute_plan

    # --- metadata helpers ---------------------------------------------------------------------------------------
    def mesh_info(self, mesh: DeviceMesh) -> _MeshInfo:
        root = mesh.root
        info = self._meshes.get(root)
        if info is None:
            info = self._meshes[root] = _MeshInfo(root, self.device)
        return info

    def local_shape(self, operand: Operand) -> tuple[int, ...]:
        """Shape of ``operand``'s shard on this device (its global shape when unbound)."""
        if operand.mesh is None:
            return operand.shape
        info = self.mesh_info(operand.mesh)
        if info.coord is None:
            raise KernelError(
                "local shape", self.device, f"{operand.describe()} does not live on this device"
            )
        return local_shape(operand.shape, info.shape, operand.root_placements, info.coord)

    def local_context(
        self, call: Any, outputs: Sequence[Operand], local: Sequence[torch.Tensor | None]
    ) -> LocalContext:
        """This rank's :class:`LocalContext` of ``call`` (``local``: its input shards), as the local path makes it."""
        info = self.mesh_info(call.mesh)
        assert info.coord is not None
        return local_context(
            call,
            info.coord,
            info.shape,
            [tuple(t.shape) if t is not None else None for t in local],
            [o.root_placements for o in outputs],
            device=self.device,
            torch_device=None if self.torch_device.type == "cpu" else self.torch_device,
            comm=self.comm,
        )

    def holds(self, operand: Operand) -> bool:
        """Whether ``operand`` lives on this device."""
        return operand.mesh is not None and self.device in self.mesh_info(operand.mesh).devices

    # --- operators ----------------------------------------------------------------------------------------------
    def run_op(self, node: Operator, *, instr: Any = None, call_site: str | None = None) -> None:
        """Run one (non-redistribute) operator: ``node.payload`` is a ``BoundOp`` (rule + call). Errors follow
        the sticky protocol of ``runtime/sticky.py``."""
        if before_hooks:
            call_hooks(before_hooks, instr if instr is not None else node, self.device)
        blobs = self.blobs
        call = StickyCall(board=self.board, key=node.outputs[0].id if node.outputs else None)
        ins: list[Blob | None] = []
        for x in node.inputs:
            if x is None:
                ins.append(None)
                continue
            b = blobs.get(x.id)
            if b is None:
                call.fail(self._missing(node, x, call_site))
                break
            if b.error is not None:  # a poisoned input: no compute
                call.fail(b.error)
                break
            ins.append(b)
        if call.error is None:
            try:
                self._compute(node, ins, call_site)
            except Exception as e:  # noqa: BLE001 - becomes the outputs' sticky error
                call.fail(kernel_error(e, op=node.name, device=self.device, call_site=call_site))
        if node.payload is not None and kernel_needs_comm(node.payload.call):
            if call.error is None:
                call.after_comm()  # a peer joined on zeros (below)
            else:
                self._join_on_zeros(node, call, call_site)  # maybe the kernel failed halfway through
        if call.poison(blobs, [o.id for o in node.outputs]):
            log.debug("worker %d: %s poisoned: %s", self.device, node.name, call.error)
        if after_hooks:
            call_hooks(after_hooks, instr if instr is not None else node, self.device)

    def _join_on_zeros(self, node: Operator, call: StickyCall, call_site: str | None) -> None:
        """A communicating kernel (context-parallel attention, a norm over a sharded dim) whose input is poisoned on
        this rank, or which failed here, runs (again) on zeros of the right local shapes: its peers wait for this
        rank's messages and must never hang. The error is posted first, so the peers (which receive after it)
        poison their outputs too. Messages a failed first attempt left behind carry this call's tag
        (``LocalContext.seq``), so no later call takes them for its own."""
        call.before_comm()
        zeros: list[Blob | None] = [
            None if x is None else Blob(self._zeros(self.local_shape(x), x.dtype, COMPUTE))
            for x in node.inputs
        ]
        try:
            self._compute(node, zeros, call_site)
        except Exception:  # noqa: BLE001 - the outputs are poisoned by the caller anyway
            log.debug("worker %d: %s on zeros failed", self.device, node.name, exc_info=True)

    def _run_rank(
        self,
        node: Operator,
        info: _MeshInfo,
        local: list[torch.Tensor | None],
        placements_out: list[Any],
        torch_device: torch.device | None,
    ) -> list[torch.Tensor]:
        bound = node.payload
        assert info.coord is not None
        return run_rank(
            bound.rule, bound.call, info.coord, info.shape, local, placements_out,
            device=self.device, torch_device=torch_device, comm=self.comm, seq=node.id,
        )  # fmt: skip

    def _compute(self, node: Operator, ins: list[Blob | None], call_site: str | None) -> None:
        call = node.payload.call
        assert call.mesh is not None, f"{node.name}: operator without a mesh reached a worker"
        info = self.mesh_info(call.mesh)
        assert info.coord is not None
        placements_out = [o.root_placements for o in node.outputs]
        stream = self.stream
        local = [b.tensor if b is not None else None for b in ins]
        if stream is not None and stream.is_cuda:
            stream.wait_for(ins, COMPUTE)
            with stream.use(COMPUTE):
                outs = self._run_rank(node, info, local, placements_out, self.torch_device)
        else:
            outs = self._run_rank(node, info, local, placements_out, None)
        self._store(node.name, outs, node.outputs, call_site)

    def _store(
        self, name: Any, outs: list[torch.Tensor], outputs: Sequence[Operand], call_site: str | None
    ) -> None:
        """Check a local kernel's outputs, stamp them on the compute stream and store them as ``outputs``' blobs
        (``name``: the operator's name, or its op, named only when an error needs it)."""
        if len(outs) != len(outputs) or self.validate:
            name = name if isinstance(name, str) else op_name(name)
        if len(outs) != len(outputs):
            raise KernelIOError(
                name,
                self.device,
                f"the local kernel returned {len(outs)} tensors, the operator has {len(outputs)} outputs",
                call_site=call_site,
            )
        if self.validate:
            for i, (t, o) in enumerate(zip(outs, outputs)):
                self.check_output(name, i, t, o, call_site)
        new = [Blob(t) for t in outs]
        if self.stream is not None:
            self.stream.stamp(new, COMPUTE)
        for o, b in zip(outputs, new):
            self.blobs[o.id] = b

    def run_resolved(
        self,
        local_call: LocalCall,
        ins: list[Blob | None],
        outputs: Sequence[Operand],
        *,
        op: Any,
        call_site: str | None = None,
    ) -> None:
        """Replay a resolved fast-path op (``runtime/replay.py``) on its input blobs (present, not poisoned):
        the same outputs, stream rules and sticky errors as :meth:`run_op`, without its per-call objects."""
        local = [b.tensor if b is not None else None for b in ins]
        stream = self.stream
        try:
            if stream is not None and stream.is_cuda:
                stream.wait_for(ins, COMPUTE)
                with stream.use(COMPUTE):
                    outs = local_call.run(local)
            else:
                outs = local_call.run(local)
            self._store(op, outs, outputs, call_site)
        except Exception as e:  # noqa: BLE001 - becomes the outputs' sticky error
            err = kernel_error(e, op=op_name(op), device=self.device, call_site=call_site)
            poison(self.blobs, [o.id for o in outputs], err)

    def run_redistribute(self, node: Operator, *, instr: Any = None, call_site: str | None = None) -> None:
        """Run this rank's part of a redistribute (``node.payload`` is the ``RedistributePlan``); a rank whose
        input is poisoned takes part on zeros (the sticky protocol of ``runtime/sticky.py``)."""
        if before_hooks:
            call_hooks(before_hooks, instr if instr is not None else node, self.device)
        x = node.inputs[0]
        y = node.outputs[0]
        assert x is not None
        plan = node.payload
        call = StickyCall(board=self.board, key=y.id)
        b: Blob | None = None
        local: torch.Tensor | None = None
        if self.holds(x):
            expected = self.local_shape(x)
            b = self.blobs.get(x.id)
            if b is None:
                call.fail(self._missing(node, x, call_site))
            elif b.error is not None:
                call.fail(b.error)
            else:
                assert b.tensor is not None
                got = b.tensor
                if tuple(got.shape) != expected or got.dtype != x.dtype:
                    call.fail(
                        KernelIOError(
                            node.name,
                            self.device,
                            f"input {x.name} holds {_describe(got)} but {x.placements_str} on this rank needs "
                            f"{_dtype(x.dtype)}{list(expected)}",
                            call_site=call_site,
                            detail="the operator that produced it returned a wrong local shape (see its rule's "
                            "localize)",
                        )
                    )
            if call.error is not None:
                b = None
                local = self._zeros(expected, x.dtype, COMM)
                call.before_comm()
            else:
                assert b is not None
                local = b.tensor
        out: torch.Tensor | None = None
        host_sync = False
        try:
            stream = self.stream
            if stream is not None and stream.is_cuda:
                host_sync = self.host_sync_collectives
                if host_sync:
                    stream.host_wait(b)  # peers' threads read this tensor on their own streams
                stream.wait_for([b], COMM)
                with stream.use(COMM):
                    out = self.execute_plan(plan, local, device=self.device, comm=self.comm)
                if host_sync:
                    # the result may have been computed on a peer thread's stream: wait for the device
                    stream.synchronize_device()
            else:
                out = self.execute_plan(plan, local, device=self.device, comm=self.comm)
        except Exception as e:  # noqa: BLE001 - becomes the output's sticky error
            call.fail(
                kernel_error(
                    e, op=node.name, device=self.device, call_site=call_site, detail=f"plan: {node.note}"
                )
            )
            call.before_comm()
        if self.holds(y):
            call.after_comm()
            if call.error is None and out is None:
                call.fail(
                    KernelError(
                        node.name, self.device, "the redistribute produced no local tensor on this rank"
                    )
                )
            if call.error is None and self.validate:
                assert out is not None
                try:
                    self.check_output(node.name, 0, out, y, call_site)
                except KernelIOError as e:
                    call.fail(e)
            if not call.poison(self.blobs, [y.id]):
                assert out is not None
                blob = Blob(out)
                if self.stream is not None:
                    # also after a host-synchronous redistribute: the output was allocated on the comm stream, and a
                    # reader on the compute stream must record_stream it (rule 3 of runtime/stream.py), or the
                    # allocator hands its memory to the next comm-stream allocation while that reader still runs
                    self.stream.stamp([blob], COMM)
                self.blobs[y.id] = blob
        if after_hooks:
            call_hooks(after_hooks, instr if instr is not None else node, self.device)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, kind: str) -> torch.Tensor:
        if self.stream is None:
            return torch.zeros(shape, dtype=dtype, device=self.torch_device)
        return self.stream.zeros(shape, dtype, kind)

    # --- checks -------------------------------------------------------------------------------------------------
    def check_output(self, op: str, index: int, t: Any, o: Operand, call_site: str | None = None) -> None:
        """Raise :class:`KernelIOError` unless ``t`` is this rank's shard of ``o`` (shape, dtype, device)."""
        if not isinstance(t, torch.Tensor):
            raise KernelIOError(
                op, self.device, f"output {index} ({o.name}) is {type(t).__name__}, not a tensor"
            )
        expected = self.local_shape(o)
        problems = []
        if tuple(t.shape) != expected:
            problems.append(f"shape {list(t.shape)}, expected {list(expected)}")
        if t.dtype != o.dtype:
            problems.append(f"dtype {_dtype(t.dtype)}, expected {_dtype(o.dtype)}")
        if t.device != self.torch_device:
            problems.append(f"device {t.device}, expected {self.torch_device}")
        if problems:
            where = o.mesh.describe(o.placements) if o.mesh is not None else "unbound"
            raise KernelIOError(
                op,
                self.device,
                f"output {index} ({o.name}: {o.type_str()} {where}) on rank {self._coord_str(o)}: "
                + "; ".join(problems),
                call_site=call_site,
            )

    def _coord_str(self, o: Operand) -> str:
        if o.mesh is None:
            return "-"
        return str(self.mesh_info(o.mesh).coord)

    def _missing(self, node: Operator, x: Operand, call_site: str | None) -> KernelError:
        return KernelError(
            node.name,
            self.device,
            f"input {x.name} has no data on this worker (never uploaded or computed here, or already freed)",
            call_site=call_site,
        )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _describe(t: torch.Tensor) -> str:
    return f"{_dtype(t.dtype)}{list(t.shape)}"
