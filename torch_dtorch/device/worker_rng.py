"""Process mode: the worker processes' generators follow the controller's when it is seeded.

Ops drawn *on the workers* (``native_dropout`` inside a compiled program: the rule's kernel, ``draw_global``) use
the default generator of the process they run in. Thread workers share the controller's, so their draws equal
torch's. A worker process starts with a generator of its own, **seeded at random by torch at process start**:
before this module, the ranks of one mesh drew *different* "global" masks — a compiled ``nn.Dropout`` of a
``Replicate`` input gave each rank another value of the same replicated tensor — and no ``torch.manual_seed``
reached them, so runs were not reproducible.

:func:`sync_worker_rng` queues a :class:`SyncWorkerRng` instruction with the controller generator's state (in issue
order, like any op); each worker process sets its own default generator (of its device: CPU, or its ``cuda:i``) to
it. It is sent when a process-mode session on the CPU starts (CUDA generators start from torch's fixed default
seed in every process, and the controller does not initialize CUDA for this) and whenever the controller's generator is set through the
dtorch device module (``device/rng.py``: ``torch.manual_seed`` reaches it through ``manual_seed_all``, and
``torch.random.fork_rng(device_type="dtorch")`` through ``set_rng_state``). So every rank draws the same global
mask, and a compiled step after ``torch.manual_seed(s)`` draws CPU torch's mask for seed ``s``. What it does not do:
the controller's generator does not advance by the workers' draws (``torch.get_rng_state()`` after a compiled step
is not CPU torch's), and controller-side draws (eager ``dropout``, ``rand``, ...) do not advance the workers'
(docs/training.md "Dropout"). ``torch.set_rng_state`` of the CPU generator does not call the device module, so it is
not forwarded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch.cluster.codec.common import CodecError, register_codec
from torch_dtorch.executor.worker import Worker, register_instruction

if TYPE_CHECKING:
    from torch_dtorch.device.state import Session  # (state.py calls sync_worker_rng at session start)

__all__ = ["SyncWorkerRng", "sync_worker_rng"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SyncWorkerRng:
    """Every worker process sets its device's default generator to ``state`` (the controller generator's
    ``get_state()`` bytes)."""

    state: bytes


def _generator_of(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else 0]
    return torch.default_generator


@register_instruction(SyncWorkerRng)
def _sync(worker: Worker, instr: SyncWorkerRng) -> None:
    try:
        state = torch.frombuffer(bytearray(instr.state), dtype=torch.uint8)
        _generator_of(worker.torch_device).set_state(state)
    except Exception:  # noqa: BLE001 - handlers must not raise; the draws stay valid, only unsynchronized
        log.exception("worker %d: could not set its generator's state", worker.device)


def sync_worker_rng(rt: Session | None, generator: torch.Generator) -> None:
    """Queue ``generator``'s state for every worker process of ``rt`` (nothing in thread mode: the workers draw
    from the controller's generator itself)."""
    if rt is None or rt.mode != "process":
        return
    executor: Any = rt.executor  # (an instruction of this layer, as the backend's and the tools' are)
    try:
        executor.append_instruction(SyncWorkerRng(bytes(generator.get_state().numpy())))
    except RuntimeError:  # a pool shut down meanwhile: ``torch.manual_seed`` itself must not fail
        log.debug("no worker processes to seed", exc_info=True)


def _register_codec() -> None:
    def enc(instr: SyncWorkerRng, ctx: Any) -> Any:
        return instr.state.hex()

    def dec(tree: Any, ctx: Any) -> SyncWorkerRng:
        try:
            return SyncWorkerRng(bytes.fromhex(tree))
        except (TypeError, ValueError) as e:
            raise CodecError(f"malformed SyncWorkerRng {tree!r:.80}: {e}") from None

    register_codec(SyncWorkerRng, tag="device.rng", encode=enc, decode=dec)


_register_codec()
