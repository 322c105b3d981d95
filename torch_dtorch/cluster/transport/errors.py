"""Typed errors of the controller <-> worker transport."""

from __future__ import annotations

from collections.abc import Iterable

from torch_dtorch.errors import DTorchError

__all__ = [
    "AuthenticationError",
    "HandshakeTimeoutError",
    "InvalidSecretError",
    "ProtocolError",
    "SequenceError",
    "TransportClosedError",
    "TransportError",
]


class TransportError(DTorchError):
    """Base class of every transport error."""


class InvalidSecretError(TransportError, ValueError):
    """The per-cluster secret is not bytes or is shorter than the minimum length."""


class ProtocolError(TransportError):
    """A message is malformed: bad magic, unsupported version, truncated frames, or an unencodable value."""


class AuthenticationError(TransportError):
    """A message's HMAC does not match: unsigned, tampered with, or signed with another secret."""


class SequenceError(TransportError):
    """A sequence number is not the next one expected: a gap (lost message) or a replay (seen before)."""

    def __init__(self, *, sender: str, expected: int, got: int, session: int | None = None) -> None:
        self.sender = sender
        self.expected = expected
        self.got = got
        kind = "replay" if got < expected else "gap"
        self.kind = kind
        where = f" (session {session:#x})" if session is not None else ""
        super().__init__(
            f"sequence {kind} from {sender!r}{where}: expected seq {expected}, got {got}"
            + (" (messages were lost)" if kind == "gap" else " (already seen: dropped)")
        )


class HandshakeTimeoutError(TransportError, TimeoutError):
    """Not every expected worker acknowledged the controller's hello before the timeout."""

    def __init__(self, *, missing: Iterable[str], timeout: float) -> None:
        self.missing = tuple(sorted(missing))
        super().__init__(
            f"handshake timed out after {timeout:.3g} s: no acknowledgement from worker(s) "
            f"{', '.join(repr(m) for m in self.missing)}. Check that they started and connect to the "
            f"right endpoints with the same cluster secret."
        )


class TransportClosedError(TransportError):
    """An operation was attempted on a closed socket."""
