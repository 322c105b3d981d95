"""The worker's data hand-offs with the controller: uploads into its blobs, fetches and barrier markers out to the
store (a mixin of :class:`~torch_dtorch.executor.worker.Worker`; process mode's CUDA IPC worker overrides
``_fetch``)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from torch_dtorch.executor.instructions import Barrier, Fetch, Upload
from torch_dtorch.runtime.blob import Blob, KernelError
from torch_dtorch.runtime.op_runner import OpRunner
from torch_dtorch.runtime.stream import COMPUTE, KernelStream

__all__ = ["WorkerTransfers"]

log = logging.getLogger(__name__)


class WorkerTransfers:
    """Upload, fetch and barrier handling for a worker: the blobs it holds, the store it shares with the
    controller, and its stream (set by :class:`~torch_dtorch.executor.worker.Worker`)."""

    device: int
    torch_device: torch.device
    store: Any
    stream: KernelStream | None
    blobs: dict[int, Blob]
    op_runner: OpRunner

    def _upload(self, instr: Upload) -> None:
        x = instr.operand
        try:
            value = self.store.pop((instr.key, self.device))
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"the store holds {type(value).__name__} under {(instr.key, self.device)}")
            if self.stream is not None and self.stream.is_cuda:
                if value.device == self.torch_device:
                    # already here (a CUDA IPC upload, copied on the receiving thread's stream and complete): the
                    # compute stream uses memory another stream allocated (rule 3 of runtime/stream.py)
                    value = self.stream.adopt(value, COMPUTE)
                else:
                    value = self.stream.upload(value, COMPUTE)
            elif value.device != self.torch_device:
                value = value.to(self.torch_device)
            if self.op_runner.validate:
                self.op_runner.check_output("upload", 0, value, x)
            blob = Blob(value)
            if self.stream is not None:
                self.stream.stamp([blob], COMPUTE)
        except KernelError as e:
            blob = Blob(error=e)
        except Exception as e:  # noqa: BLE001 - becomes the operand's sticky error
            err = KernelError("upload", self.device, e, detail=f"of {x.describe()}")
            err.__cause__ = e
            blob = Blob(error=err)
        self.blobs[x.id] = blob

    def _fetch(self, instr: Fetch) -> None:
        x = instr.operand
        value: Any
        b = self.blobs.get(x.id)
        try:
            if b is None:
                value = KernelError(
                    "fetch",
                    self.device,
                    f"{x.name} has no data on this worker (never uploaded or computed here, or already freed)",
                )
            elif b.error is not None:
                value = b.error
            else:
                assert b.tensor is not None
                if self.stream is not None and self.stream.is_cuda:
                    self.stream.wait_for([b], COMPUTE)
                    with self.stream.use(COMPUTE):
                        value = b.tensor.to("cpu", copy=True)
                else:
                    value = b.tensor.clone()
        except Exception as e:  # noqa: BLE001 - delivered to the controller instead of a tensor
            value = KernelError("fetch", self.device, e, detail=f"of {x.name}")
        self.store.put((instr.key, self.device), value)

    def _barrier(self, instr: Barrier) -> None:
        if self.stream is not None:
            try:
                self.stream.synchronize()
            except Exception:  # noqa: BLE001 - the marker must still arrive
                log.exception("worker %d: synchronize failed at a barrier", self.device)
        self.store.put((instr.key, self.device), torch.empty(0))
