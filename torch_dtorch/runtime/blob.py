"""``Blob``: the local tensor of one operand on one device, or the sticky error that replaced it."""

from __future__ import annotations

from typing import Any

import torch

from torch_dtorch.errors import DTorchError

__all__ = ["Blob", "KernelError"]


class KernelError(DTorchError, RuntimeError):
    """A local kernel failed on a worker.

    Sticky: the failing operator's outputs, and everything computed from them, hold this error instead of a tensor;
    the first value request that depends on them raises it on the controller.

    Attributes:
        op: name of the operator that failed (``aten.mm``, ``redistribute``).
        device: the worker (device id / rank) it failed on.
        cause: the original exception (also chained as ``__cause__`` when raised).
        call_site: the user's call site (``file:line in fn``), recorded with ``DTORCH_DEBUG=1``.
    """

    def __init__(
        self,
        op: str,
        device: int,
        cause: BaseException | str,
        *,
        call_site: str | None = None,
        detail: str = "",
    ) -> None:
        self.op = op
        self.device = device
        self.cause = cause
        self.call_site = call_site
        self.detail = detail
        what = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(cause)
        lines = [f"{op} failed on worker {device}: {what}"]
        if detail:
            lines.append(f"  {detail}")
        if call_site:
            lines.append(f"  called from: {call_site}")
        elif not _debug():
            lines.append("  (set DTORCH_DEBUG=1 to record the call site of every op)")
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable for process mode
        return (_rebuild, (type(self), self.op, self.device, self.cause, self.call_site, self.detail))

    def again(self, context: str = "") -> KernelError:
        """A fresh copy to raise on the controller (same type and fields), with ``context`` appended."""
        err = type(self)(self.op, self.device, self.cause, call_site=self.call_site, detail=self.detail)
        if context:
            err.args = (f"{err.args[0]}\n  while {context}",)
        return err


def _rebuild(
    cls: type[KernelError], op: str, device: int, cause: Any, call_site: Any, detail: str
) -> KernelError:
    return cls(op, device, cause, call_site=call_site, detail=detail)


def _debug() -> bool:
    from torch_dtorch.config import get_config

    return get_config().debug


class Blob:
    """One operand's local tensor on one device (``tensor``), or a sticky ``error``.

    On CUDA, ``stream`` names the stream that wrote the tensor (``"compute"`` or ``"comm"``). A reader on the other
    stream makes its stream wait for an event recorded on the writer's stream when it reads (streams run in order,
    so that event follows the write; no event is made for the many blobs never read across streams). ``waited``
    names the one other stream already ordered after the write and told to the allocator; it need not wait again
    while nothing more was written on the writer's stream (``waited_at``; a program reading a thousand parameters
    would otherwise queue a thousand event waits per call).
    """

    __slots__ = ("tensor", "error", "stream", "waited", "waited_at")

    def __init__(
        self,
        tensor: torch.Tensor | None = None,
        *,
        error: KernelError | None = None,
        stream: str | None = None,
    ) -> None:
        if (tensor is None) == (error is None):
            raise ValueError("Blob: give exactly one of tensor= and error=")
        self.tensor = tensor
        self.error = error
        self.stream = stream
        self.waited: str | None = None
        #: the writer stream's stamp count when ``waited`` was ordered after it (``KernelStream.wait_for``)
        self.waited_at = 0

    @classmethod
    def poisoned(cls, error: KernelError) -> Blob:
        return cls(error=error)

    @property
    def ok(self) -> bool:
        return self.error is None

    def __repr__(self) -> str:
        if self.error is not None:
            return f"Blob(error={self.error.op!r} on worker {self.error.device})"
        t = self.tensor
        assert t is not None
        return f"Blob({str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device})"
