"""``CodecLoopbackRunner``: a ThreadRunner whose batches travel the whole process-mode path first — the codec
(:mod:`torch_dtorch.cluster.codec`) and the signed wire format — so thread-mode tests exercise serialization."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from torch_dtorch.cluster import codec
from torch_dtorch.cluster.transport import wire
from torch_dtorch.executor.instructions import Instruction
from torch_dtorch.executor.thread_runner import ThreadRunner

__all__ = ["CodecLoopbackRunner"]


class CodecLoopbackRunner:
    """Encodes every batch (controller side), signs and frames it, verifies and decodes it (worker side), then hands
    the decoded instructions to a :class:`ThreadRunner`. ``decoded`` keeps the last decoded batch for inspection."""

    def __init__(self, devices: Sequence[int], *, secret: bytes | None = None, **kwargs: Any) -> None:
        self.inner = ThreadRunner(devices, **kwargs)
        self.devices = self.inner.devices
        self.store = self.inner.store
        self.secret = secret if secret is not None else secrets.token_bytes(32)
        self.encoder = codec.BatchEncoder()
        self.decoder = codec.BatchDecoder()
        self.seq = 0
        self.num_bytes = 0
        self.decoded: list[Instruction] = []

    def submit(self, batch: Sequence[Instruction]) -> None:
        self.seq += 1
        frames = wire.encode(
            self.encoder.encode(batch),
            kind=wire.MessageKind.BATCH,
            seq=self.seq,
            sender="controller",
            secret=self.secret,
        )
        self.num_bytes += sum(len(memoryview(f).cast("B")) for f in frames)
        msg = wire.decode(frames, secret=self.secret)
        # a worker process decodes its next batch only after running the previous one (hit records materialized
        # while a batch runs read the decoder's tables as of that batch): the threads must be done too
        self.inner.wait_idle()
        self.decoded = self.decoder.decode(msg.body)
        self.inner.submit(self.decoded)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self.inner.wait_idle(timeout)

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def shutdown(self, *, timeout: float = 10.0) -> None:
        self.inner.shutdown(timeout=timeout)

    def __repr__(self) -> str:
        return f"CodecLoopbackRunner({self.inner!r})"
