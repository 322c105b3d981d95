"""Communicating kernels: rule kernels that talk to the other ranks of their call.

Most rule kernels compute on their rank's shards alone. A few combine shards with a finishing exchange instead of a
redistribute: context-parallel attention (``context_parallel.py``), p-norms and ``prod`` over a sharded dim
(``norm_comm.py``), ``nll_loss`` (``loss_nll.py``), ``cat`` along a sharded dim (``cat_comm.py``) and the
attention backward (``attention_backward.py``). Such a rule declares it with :func:`register_comm_kernel`; its
kernel asks :func:`device_comm` for the rank's communicator (``LocalContext.comm``, given by the runtime's
``OpRunner``; the simulator's ``run_all_ranks`` gives a thread per rank one) and moves pieces with :func:`exchange`
or the communicator's ``send`` / ``recv``. On workers the communicator stamps every point-to-point tag with the
call's number, so messages of different calls never match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch.errors import DTorchError
from torch_dtorch.placement_rules.call import LocalContext, OpCall

__all__ = [
    "CP_TAG",
    "ContextParallelError",
    "device_comm",
    "exchange",
    "kernel_needs_comm",
    "register_comm_kernel",
]

#: point-to-point tag of the CP kernels (messages between one pair with one tag arrive in order)
CP_TAG = 0x6370


class ContextParallelError(DTorchError, RuntimeError):
    """A communicating kernel that cannot run (no communicator, no head dim for Ulysses, ...)."""


def device_comm(ctx: LocalContext, what: str = "context-parallel attention") -> Any:
    """The rank's communicator (``ctx.comm``, given by the runtime's ``OpRunner``); ``what`` names the kernel in the
    error raised without one."""
    if ctx.comm is None:
        raise ContextParallelError(
            f"{what} on device {ctx.device}: no communicator. Communicating kernels run on workers "
            "(dt.init_device_mesh) or in the simulator's run_all_ranks (a thread per rank); a lone run_rank (the "
            "ReferenceExecutor) cannot run them"
        )
    return ctx.comm if ctx.seq is None else _CallComm(ctx.comm, ctx.seq)


#: call numbers wrap after this many calls (tags stay below 2**29: ``torch.distributed`` groups use 2 * tag + 1)
_SEQ_WRAP = (1 << 13) - 1


class _CallComm:
    """The rank's communicator with the call's number in every point-to-point tag (bits 16-28; the kernel's own tag
    keeps bits 0-15). Messages of different calls never match: a rank that fails halfway through an exchange
    leaves messages that no later call consumes (before, the next call of the same kernel took them for its own)."""

    __slots__ = ("_comm", "_high")

    def __init__(self, comm: Any, seq: int) -> None:
        self._comm = comm
        self._high = (seq % _SEQ_WRAP + 1) << 16

    def _tag(self, tag: int) -> int:
        if not 0 <= tag < 1 << 16:
            raise ValueError(f"point-to-point tags of communicating kernels must be in [0, 65536), got {tag}")
        return self._high | tag

    def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> Any:
        return self._comm.send(t, dst, self._tag(tag))

    def recv(self, src: int, tag: int = 0) -> torch.Tensor:
        return self._comm.recv(src, self._tag(tag))

    def __getattr__(self, name: str) -> Any:  # group(), device, ...: the communicator's own
        return getattr(self._comm, name)


#: op -> predicate: does this call's local kernel communicate (needs ``LocalContext.comm``)?
_COMM_KERNELS: dict[Any, Callable[[OpCall], bool]] = {}


def register_comm_kernel(op: Any, needs_comm: Callable[[OpCall], bool]) -> None:
    """Declare that ``op``'s rule kernel talks to other ranks when ``needs_comm(call)`` is true. The compiled
    back end runs such calls as their own program step with the worker's communicator (``backend/local.py``)."""
    _COMM_KERNELS[op] = needs_comm


def kernel_needs_comm(call: OpCall) -> bool:
    """Whether the local kernel of ``call`` needs the worker's communicator (context-parallel attention, p-norms and
    ``prod`` over a sharded dim: ``norm_comm.py``)."""
    pred = _COMM_KERNELS.get(call.op)
    return pred is not None and pred(call)


# --- point-to-point exchange ----------------------------------------------------------------------------------
def exchange(
    comm: Any, devices: Sequence[int], me: int, pieces: Sequence[torch.Tensor], *, tag: int = CP_TAG
) -> list[torch.Tensor]:
    """All-to-all with arbitrary pieces: ``pieces[t]`` goes to member ``t``; returns what every member sent me."""
    works = [comm.send(p.contiguous(), d, tag) for t, (d, p) in enumerate(zip(devices, pieces)) if t != me]
    got = [pieces[me] if s == me else comm.recv(d, tag) for s, d in enumerate(devices)]
    for w in works:
        w.wait()
    return got
