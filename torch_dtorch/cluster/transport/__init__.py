"""Controller <-> worker transport: signed, versioned wire format (:mod:`.wire`) over ZMQ (:mod:`.zmq_transport`)."""

from __future__ import annotations

from torch_dtorch.cluster.transport.errors import (
    AuthenticationError,
    HandshakeTimeoutError,
    InvalidSecretError,
    ProtocolError,
    SequenceError,
    TransportClosedError,
    TransportError,
)
from torch_dtorch.cluster.transport.wire import Message, MessageKind, decode, encode, sign, verify
from torch_dtorch.cluster.transport.zmq_transport import (
    Publisher,
    Puller,
    Pusher,
    Receiver,
    Sender,
    Subscriber,
    Transport,
)

__all__ = [
    "AuthenticationError",
    "HandshakeTimeoutError",
    "InvalidSecretError",
    "Message",
    "MessageKind",
    "ProtocolError",
    "Publisher",
    "Puller",
    "Pusher",
    "Receiver",
    "Sender",
    "SequenceError",
    "Subscriber",
    "Transport",
    "TransportClosedError",
    "TransportError",
    "decode",
    "encode",
    "sign",
    "verify",
]
