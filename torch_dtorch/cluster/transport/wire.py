"""Versioned, signed frame format of controller <-> worker messages.

A message is a list of ZMQ frames::

    [header, payload, buffer_0, ..., buffer_{n-1}]

* ``header``: ``struct`` ``!4sHHQQIH`` = magic ``b"DTRW"``, format version, :class:`MessageKind`, session id,
  sequence number, number of buffer frames, length of the sender id; then the UTF-8 sender id; then the 32-byte
  HMAC-SHA256 tag.
* ``payload``: UTF-8 JSON of the body with a few tagged objects (below). Standard JSON only: the decoder refuses
  ``NaN`` / ``Infinity`` literals, payloads over :data:`MAX_PAYLOAD_BYTES` (``DTORCH_WIRE_MAX_PAYLOAD_BYTES``,
  checked before the signature is computed) and nesting deeper than :data:`MAX_DEPTH` levels, with a
  :class:`ProtocolError` naming the sender (as its header claims it, and the socket's peer address where known).
* ``buffer_i``: raw bytes of a contiguous CPU tensor (sent zero-copy from a ``memoryview``) or of a ``bytes`` value.

The tag is HMAC-SHA256 with the per-cluster secret over the header (without the tag) followed by, for every other
frame, its length (``!Q``) and its bytes; the frame count is in the header, so nothing can be added, dropped, cut or
moved without failing :func:`verify`. :func:`decode` verifies before it parses the payload; nothing is unpickled.

Payload encoding (JSON values pass through; everything else is a one-key object)::

    tuple -> {"t": [...]}          dict -> {"d": [[k, v], ...]}     float nan/inf -> {"f": "nan" | "inf" | "-inf"}
    bytes -> {"b": i}              torch.dtype -> {"dtype": "bfloat16"}   torch.device -> {"device": "cuda:0"}
    torch.Size -> {"size": [...]}  torch.Tensor -> {"T": i, "dtype": "float32", "shape": [...]}

Tensors are detached, moved to the CPU and made contiguous (conj/neg bits resolved) before sending; the receiver
gets a contiguous tensor of the same shape/dtype/values (bit-exact) that aliases the received frame's memory.
"""

from __future__ import annotations

import enum
import hmac
import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

import torch

from torch_dtorch.cluster.transport.errors import (
    AuthenticationError,
    InvalidSecretError,
    ProtocolError,
)

__all__ = [
    "MAGIC",
    "MIN_SECRET_BYTES",
    "VERSION",
    "Message",
    "MessageKind",
    "check_secret",
    "claimed_sender",
    "decode",
    "encode",
    "sign",
    "verify",
]

MAGIC = b"DTRW"
VERSION = 1
MIN_SECRET_BYTES = 32
TAG_BYTES = 32
_HEADER = struct.Struct("!4sHHQQIH")
_FRAME_LEN = struct.Struct("!Q")
_MAX_DEPTH = 64
MAX_DEPTH = _MAX_DEPTH
_MAX_U64 = 2**64 - 1


def _env_max_payload() -> int:
    raw = os.environ.get("DTORCH_WIRE_MAX_PAYLOAD_BYTES", "").strip()
    if not raw:
        return 256 << 20
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"DTORCH_WIRE_MAX_PAYLOAD_BYTES={raw!r} is not an integer") from None
    if value < 1024:
        raise ValueError(f"DTORCH_WIRE_MAX_PAYLOAD_BYTES={raw!r} must be >= 1024")
    return value


#: the largest JSON payload frame a receiver parses (tensor bytes travel in buffer frames, not counted here)
MAX_PAYLOAD_BYTES = _env_max_payload()

Frame = bytes | bytearray | memoryview

TENSOR_ALIGN = 64
"""Received tensors start at a multiple of this many bytes, as torch's CPU allocator places them."""

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


class MessageKind(enum.IntEnum):
    """What a message is; the receiver dispatches on it."""

    HELLO = 1  # controller -> workers (PUB): handshake probe, body {"nonce": str}
    HELLO_ACK = 2  # worker -> controller (PUSH): body {"nonce": str}
    BATCH = 3  # controller -> workers (PUB): an ordered batch of instructions
    ACK = 4  # worker -> controller: a batch was executed
    VALUE = 5  # worker -> controller: a requested value (tensors travel as buffer frames)
    ERROR = 6  # worker -> controller: a failure report
    SHUTDOWN = 7  # controller -> workers
    JOIN = 8  # worker -> controller (cluster control socket): a worker asks to join, body {"device", "nonce", ...}
    WELCOME = 9  # controller -> one worker (control socket): endpoints and settings, echoes the join nonce


@dataclass(frozen=True, slots=True)
class Message:
    """One authenticated, decoded message."""

    kind: MessageKind
    seq: int
    sender: str
    session: int
    body: Any


def check_secret(secret: object) -> bytes:
    """Return ``secret`` if it is a usable per-cluster secret (``bytes`` of at least 32 bytes)."""
    if not isinstance(secret, bytes):
        raise InvalidSecretError(f"the cluster secret must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise InvalidSecretError(
            f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)} "
            f"(generate one with secrets.token_bytes({MIN_SECRET_BYTES}))"
        )
    return secret


def _view(frame: object) -> memoryview:
    # zmq.Frame exposes its bytes as ``.buffer``; bytes/bytearray/memoryview are taken as they are.
    buf = getattr(frame, "buffer", frame)
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except TypeError as e:
        raise ProtocolError(f"a frame must be a bytes-like object, got {type(frame).__name__}") from e
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def sign(header: Frame, frames: Sequence[Frame], *, secret: bytes) -> bytes:
    """HMAC-SHA256 tag over ``header`` (without tag) and the length-prefixed ``frames``."""
    mac = hmac.new(check_secret(secret), digestmod=sha256)
    mac.update(header)
    for f in frames:
        mv = _view(f)
        mac.update(_FRAME_LEN.pack(mv.nbytes))
        mac.update(mv)
    return mac.digest()


def _parse_header(frames: Sequence[object]) -> tuple[tuple[Any, ...], str, memoryview]:
    if len(frames) < 2:
        raise ProtocolError(f"truncated message: {len(frames)} frame(s), need at least 2 (header, payload)")
    header = _view(frames[0])
    if header.nbytes < _HEADER.size + TAG_BYTES:
        raise ProtocolError(f"truncated header: {header.nbytes} bytes")
    fields = _HEADER.unpack_from(header)
    magic, version, _kind, _session, _seq, n_buffers, sender_len = fields
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a dtorch transport message")
    if version != VERSION:
        raise ProtocolError(f"unsupported wire format version {version} (this side speaks {VERSION})")
    if header.nbytes != _HEADER.size + sender_len + TAG_BYTES:
        raise ProtocolError(f"header length {header.nbytes} does not match sender length {sender_len}")
    if len(frames) != 2 + n_buffers:
        raise ProtocolError(f"truncated message: {len(frames)} frames, header announces {2 + n_buffers}")
    payload_bytes = _view(frames[1]).nbytes
    if payload_bytes > MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            f"payload of {payload_bytes} bytes is over the limit of {MAX_PAYLOAD_BYTES} "
            "(DTORCH_WIRE_MAX_PAYLOAD_BYTES)"
        )
    sender_bytes = bytes(header[_HEADER.size : _HEADER.size + sender_len])
    try:
        sender = sender_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProtocolError("sender id is not UTF-8") from e
    return fields, sender, header


def verify(frames: Sequence[object], *, secret: bytes) -> None:
    """Raise :class:`ProtocolError` if ``frames`` are not a well-formed message, :class:`AuthenticationError` if the
    tag does not match. Reads only the fixed header fields before checking the tag."""
    _fields, _sender, header = _parse_header(frames)
    body = header[: header.nbytes - TAG_BYTES]
    expected = sign(body, [_view(f) for f in frames[1:]], secret=secret)
    if not hmac.compare_digest(expected, bytes(header[header.nbytes - TAG_BYTES :])):
        raise AuthenticationError(
            "message signature does not match: unsigned, tampered, or wrong cluster secret"
        )


def encode(
    obj: Any, *, kind: MessageKind, seq: int, sender: str, secret: bytes, session: int = 0
) -> list[Frame]:
    """Encode and sign ``obj``; returns ``[header, payload, *buffers]`` (buffers are zero-copy views)."""
    if not (0 <= seq <= _MAX_U64 and 0 <= session <= _MAX_U64):
        raise ProtocolError(f"seq and session must fit in 64 unsigned bits, got seq={seq} session={session}")
    buffers: list[Frame] = []
    try:
        payload = json.dumps(_enc(obj, buffers, 0), separators=(",", ":"), allow_nan=False).encode()
    except RecursionError as e:  # pragma: no cover - _MAX_DEPTH fires first
        raise ProtocolError("payload nests too deeply") from e
    sender_bytes = sender.encode("utf-8")
    if len(sender_bytes) > 0xFFFF:
        raise ProtocolError("sender id longer than 65535 bytes")
    head = (
        _HEADER.pack(MAGIC, VERSION, int(kind), session, seq, len(buffers), len(sender_bytes)) + sender_bytes
    )
    tag = sign(head, [payload, *buffers], secret=secret)
    return [head + tag, payload, *buffers]


def decode(frames: Sequence[object], *, secret: bytes) -> Message:
    """Verify then decode a message produced by :func:`encode`."""
    verify(frames, secret=secret)
    fields, sender, _header = _parse_header(frames)
    _magic, _version, kind, session, seq, _n, _slen = fields
    try:
        mkind = MessageKind(kind)
    except ValueError as e:
        raise ProtocolError(f"unknown message kind {kind}") from e
    where = f"{mkind.name} seq {seq} from {sender!r}"
    try:
        tree = json.loads(bytes(_view(frames[1])), parse_constant=_no_constant)
    except ValueError as e:  # not UTF-8, not JSON, or a non-standard literal
        raise ProtocolError(f"{where}: payload is not valid JSON: {e}") from e
    except RecursionError:
        raise ProtocolError(f"{where}: payload nests deeper than {_MAX_DEPTH} levels") from None
    buffers = [_view(f) for f in frames[2:]]
    try:
        body = _dec(tree, buffers, 0)
    except ProtocolError as e:
        raise ProtocolError(f"{where}: {e}") from None
    return Message(kind=mkind, seq=seq, sender=sender, session=session, body=body)


def _no_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON literal {name} (standard JSON only)")


def claimed_sender(frames: Sequence[object]) -> str:
    """Who ``frames`` say they come from (the header's sender id, unverified), for error messages."""
    try:
        _fields, sender, _header = _parse_header(frames)
    except ProtocolError:
        return "<unreadable header>"
    return repr(sender)


# ---------------------------------------------------------------------------------------------------------------
# payload encoding
# ---------------------------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_frame(t: torch.Tensor) -> Frame:
    if t.layout != torch.strided:
        raise ProtocolError(f"only strided tensors can be sent, got layout {t.layout}")
    if t.numel() == 0:  # e.g. barrier markers
        return b""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if t.numel() == 0:
        return b""
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # one element broadcast (e.g. ones(()).expand(1, 1)): contiguous, yet stride 0
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8).numpy().data  # a memoryview; keeps the array alive


#: JSON scalars passed through as they are (exact types: subclasses such as IntEnum take the general path)
_PLAIN = frozenset({type(None), bool, int, str})


def _enc(obj: Any, bufs: list[Frame], depth: int) -> Any:
    # fast paths for the common shapes (dicts with str keys, lists of scalars); same output as _enc_any
    tp = type(obj)
    if tp in _PLAIN:
        return obj
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"payload nests deeper than {_MAX_DEPTH} levels (or contains a cycle)")
    d = depth + 1
    if tp is dict:
        return {
            "d": [
                [k if type(k) in _PLAIN else _enc(k, bufs, d), v if type(v) in _PLAIN else _enc(v, bufs, d)]
                for k, v in obj.items()
            ]
        }
    if tp is list:
        return [x if type(x) in _PLAIN else _enc(x, bufs, d) for x in obj]
    if tp is tuple:
        return {"t": [x if type(x) in _PLAIN else _enc(x, bufs, d) for x in obj]}
    return _enc_any(obj, bufs, depth)


def _enc_any(obj: Any, bufs: list[Frame], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"payload nests deeper than {_MAX_DEPTH} levels (or contains a cycle)")
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"f": repr(obj)}
    if isinstance(obj, list):
        return [_enc(x, bufs, depth + 1) for x in obj]
    if isinstance(obj, torch.Size):
        return {"size": list(obj)}
    if isinstance(obj, tuple):
        return {"t": [_enc(x, bufs, depth + 1) for x in obj]}
    if isinstance(obj, dict):
        return {"d": [[_enc(k, bufs, depth + 1), _enc(v, bufs, depth + 1)] for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        bufs.append(obj)
        return {"b": len(bufs) - 1}
    if isinstance(obj, torch.dtype):
        return {"dtype": _dtype_name(obj)}
    if isinstance(obj, torch.device):
        return {"device": str(obj)}
    if isinstance(obj, torch.Tensor):
        bufs.append(_tensor_frame(obj))
        return {"T": len(bufs) - 1, "dtype": _dtype_name(obj.dtype), "shape": list(obj.shape)}
    raise ProtocolError(f"cannot encode a value of type {type(obj).__qualname__} in a transport message")


def _buffer(bufs: list[memoryview], i: object) -> memoryview:
    if type(i) is not int or not 0 <= i < len(bufs):
        raise ProtocolError(f"payload references buffer frame {i!r}, message has {len(bufs)}")
    return bufs[i]


def _dec_tensor(tree: dict[str, Any], bufs: list[memoryview]) -> torch.Tensor:
    buf = _buffer(bufs, tree["T"])
    dtype = _DTYPES.get(tree.get("dtype"))  # type: ignore[arg-type]
    shape = tree.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
        raise ProtocolError(f"bad tensor metadata {tree!r}")
    numel = math.prod(shape)
    if buf.nbytes != numel * dtype.itemsize:
        raise ProtocolError(
            f"tensor frame holds {buf.nbytes} bytes, {dtype} {shape} needs {numel * dtype.itemsize}"
        )
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device="cpu")
    if buf.readonly:  # e.g. a bytes object: torch.frombuffer would warn about writes; copy once
        buf = memoryview(bytearray(buf))
    t = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    if t.data_ptr() % TENSOR_ALIGN:
        # a frame's bytes start wherever the transport put them; vectorized CPU kernels (BLAS) take another code
        # path on unaligned data and round differently (a linear's last bits changed): copy into torch's allocator
        t = t.clone()
    return t


_JSON_PLAIN = frozenset({type(None), bool, int, float, str})


def _dec(tree: Any, bufs: list[memoryview], depth: int) -> Any:
    # fast paths for dict nodes with plain keys/values and lists of scalars; same result as _dec_any
    tp = type(tree)
    if tp in _JSON_PLAIN:
        return tree
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"payload nests deeper than {_MAX_DEPTH} levels")
    d = depth + 1
    if tp is list:
        return [x if type(x) in _JSON_PLAIN else _dec(x, bufs, d) for x in tree]
    if tp is dict and len(tree) == 1:
        val = tree.get("d")
        if type(val) is list:
            try:
                return {
                    (k if type(k) in _JSON_PLAIN else _dec(k, bufs, d)): (
                        v if type(v) in _JSON_PLAIN else _dec(v, bufs, d)
                    )
                    for k, v in val
                }
            except (ValueError, TypeError) as e:
                raise ProtocolError(f"bad payload node {tree!r}: {e}") from e
    return _dec_any(tree, bufs, depth)


def _dec_any(tree: Any, bufs: list[memoryview], depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"payload nests deeper than {_MAX_DEPTH} levels")
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree
    if isinstance(tree, list):
        return [_dec(x, bufs, depth + 1) for x in tree]
    if not isinstance(tree, dict) or not tree:
        raise ProtocolError(f"bad payload node {tree!r}")
    try:
        if "T" in tree:
            return _dec_tensor(tree, bufs)
        ((tag, val),) = tree.items()
        if tag == "t":
            return tuple(_dec(x, bufs, depth + 1) for x in val)
        if tag == "d":
            return {_dec(k, bufs, depth + 1): _dec(v, bufs, depth + 1) for k, v in val}
        if tag == "f" and val in ("nan", "inf", "-inf"):
            return float(val)
        if tag == "b":
            return bytes(_buffer(bufs, val))
        if tag == "dtype" and val in _DTYPES:
            return _DTYPES[val]
        if tag == "device" and isinstance(val, str):
            return torch.device(val)
        if tag == "size" and isinstance(val, list) and all(type(s) is int for s in val):
            return torch.Size(val)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ProtocolError(f"bad payload node {tree!r}: {e}") from e
    raise ProtocolError(f"bad payload node {tree!r}")
