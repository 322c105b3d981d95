"""When a process-mode batch leaves the controller: the :class:`Outbox` of a
:class:`~torch_dtorch.cluster.runner.ClusterRunner`.

The executor hands the runner *chunks* of at most :data:`CHUNK` instructions (its batch size in process mode; also
whatever its flush timer, a value request or a full batch sends). Each message costs a signed send, a wake-up and a
decode on every worker, and the native chain a worker runs ends with its message, so the outbox publishes

- **at once** while fewer than :data:`WINDOW` messages are unacknowledged by the slowest worker: an idle worker
  starts on the first chunk while the controller records the next one, and one message may wait behind the one a
  worker runs (an acknowledgement reaches the controller's receiver thread only when the recording thread lets go of
  the GIL, up to ``sys.getswitchinterval()`` = 5 ms later: with a window of 1 a fast worker would sit idle that
  long);
- **held** while the workers are busy (:data:`WINDOW` messages in flight): the chunks gather and go as one message
  when the slowest worker acknowledges (the receiver thread publishes them), or as soon as ``max_held``
  instructions (``DTORCH_CLUSTER_BATCH_SIZE``, default 256) are held, so a worker that falls behind gets fewer,
  larger messages and longer native chains;
- **at once, with everything held before it**, for a chunk with anything but plain work (:data:`HOLDABLE`): a
  barrier (``dt.sync()``), a fetch, a compiled program, a custom instruction — whatever a caller may wait for;
- **everything held** on :meth:`flush`: ``wait_idle``, a graceful shutdown (before ``SHUTDOWN``; a script that ends
  without ``dt.shutdown()`` goes through the same atexit shutdown).

Nothing is held across a failure: the runner drops held work with the batches it no longer sends. Callers hold the
runner's send lock around every method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch_dtorch.executor.instructions import FastRun, Free, Instruction, Redistribute, RunOp, Upload

__all__ = ["CHUNK", "HOLDABLE", "WINDOW", "Outbox"]

#: instructions per chunk the executor hands over in process mode (its batch size there)
CHUNK = 64
#: messages a worker may have unacknowledged before chunks are held for it (1: only idle workers get one at once;
#: on the tiny FLUX step, 2-core VM, windows 1, 2, 4 and 8 were within the noise of each other: docs/benchmarks.md)
WINDOW = 2
#: instruction types a busy worker's outbox may hold: plain work nobody waits for by itself
HOLDABLE: frozenset[type] = frozenset({FastRun, RunOp, Redistribute, Free, Upload})


class Outbox:
    """Held instructions and the decision to publish them (see the module docstring).

    Args:
        publish: sends one batch (encodes, signs, publishes; returns nothing).
        in_flight: how many published messages the slowest worker has not acknowledged.
        max_held: publish once this many instructions are held, busy or not.
        window: messages in flight before chunks are held (:data:`WINDOW`; 1: only idle workers get a chunk at once).
    """

    def __init__(
        self,
        publish: Callable[[list[Any]], None],
        in_flight: Callable[[], int],
        *,
        max_held: int,
        window: int = WINDOW,
    ) -> None:
        if max_held < 1 or window < 1:
            raise ValueError(f"Outbox: max_held and window must be >= 1, got {max_held}, {window}")
        self._publish = publish
        self._in_flight = in_flight
        self.max_held = max_held
        self.window = window
        self._held: list[Any] = []
        #: messages published, and instructions in them (``bench/process_wire.py``, tests)
        self.messages = 0
        self.instructions = 0

    def __len__(self) -> int:
        return len(self._held)

    def submit(self, batch: Sequence[Instruction]) -> None:
        """Publish ``batch`` (with what is held) now, or hold it."""
        held = self._held
        held.extend(batch)
        if not held:
            return
        if len(held) >= self.max_held or self._in_flight() < self.window:
            self.flush()
            return
        for instr in batch:
            if type(instr) not in HOLDABLE:
                self.flush()
                return

    def on_ack(self) -> None:
        """A worker acknowledged: publish what is held once fewer than ``window`` messages are in flight."""
        if self._held and self._in_flight() < self.window:
            self.flush()

    def flush(self) -> None:
        """Publish everything held as one message."""
        batch, self._held = self._held, []
        if batch:
            self.messages += 1
            self.instructions += len(batch)
            self._publish(batch)

    def drop(self) -> int:
        """Forget what is held (the cluster failed or was shut down); returns how many instructions."""
        n, self._held = len(self._held), []
        return n
