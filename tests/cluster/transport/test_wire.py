from __future__ import annotations

import re
import secrets
import time

import pytest
import torch

from torch_dtorch.cluster.transport import (
    AuthenticationError,
    InvalidSecretError,
    MessageKind,
    ProtocolError,
    TransportError,
    decode,
    encode,
    verify,
)
from torch_dtorch.cluster.transport.wire import TENSOR_ALIGN, VERSION

SECRET = secrets.token_bytes(32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8)


def _same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and b.is_contiguous()
        assert torch.equal(_bytes(a), _bytes(b)) or a.numel() == 0
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
        for x, y in zip(a, b):  # type: ignore[call-overload]
            _same(x, y)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b
    else:
        assert type(a) is type(b) and a == b


def test_round_trip_nested_payload_bit_exact() -> None:
    g = torch.Generator().manual_seed(0)
    body = {
        "ops": [
            {
                "op": "aten.mm",
                "args": (1, 2.5, -3, None, True),
                "dtype": torch.bfloat16,
                "dev": torch.device("cuda:1"),
            },
            (torch.randn(4, 5, generator=g), torch.randn(3, 3, generator=g).to(torch.bfloat16)),
        ],
        "idx": torch.arange(24, dtype=torch.int64).reshape(2, 3, 4).permute(2, 0, 1),  # non-contiguous
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0, 7, dtype=torch.float32),
        "mask": torch.tensor([True, False, True]),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        "floats": (float("nan"), float("inf"), float("-inf"), 1e-310),
        "size": torch.Size([2, 3]),
        "blob": b"\x00\xffraw",
        7: "int key",
        ("tuple", "key"): [],
        "big": 2**80,
        "text": "ünïcode",
    }
    frames = encode(body, kind=MessageKind.BATCH, seq=5, sender="controller", secret=SECRET, session=9)
    assert len(frames) == 2 + 8  # 7 tensors + 1 bytes
    msg = decode(frames, secret=SECRET)
    assert (msg.kind, msg.seq, msg.sender, msg.session) == (MessageKind.BATCH, 5, "controller", 9)
    _same(body, msg.body)
    assert msg.body["idx"].stride() == (6, 3, 1) and msg.body["scalar"].dim() == 0


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(()).expand(1, 1),  # contiguous (size-1 dims), yet its flat view has stride 0
        lambda: torch.tensor([2.5]).expand(1, 1, 1),
        lambda: torch.arange(3.0)[1:2].expand(1, 1),
        lambda: torch.ones(1).expand(5),
    ],
    ids=["0d-to-1x1", "1-to-1x1x1", "offset", "broadcast-5"],
)
def test_expanded_tensors_round_trip(make: object) -> None:
    t = make()  # type: ignore[operator]
    frames = encode({"t": t}, kind=MessageKind.VALUE, seq=1, sender="w0", secret=SECRET)
    _same({"t": t}, decode(frames, secret=SECRET).body)


def test_tensor_frames_are_zero_copy_views() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    frames = encode([t], kind=MessageKind.VALUE, seq=1, sender="w0", secret=SECRET)
    assert isinstance(frames[2], memoryview) and frames[2].nbytes == 4000
    assert decode(frames, secret=SECRET).body[0][999].item() == 999.0
    t[0] = 42.0  # the frame aliases the tensor's memory: mutating before the send completes breaks the tag
    with pytest.raises(AuthenticationError):
        decode(frames, secret=SECRET)


def test_received_tensors_are_aligned_like_torchs_allocator() -> None:
    # a frame may start at any address; an unaligned weight made a 1-row linear differ in its last bits from the
    # controller's (vectorized BLAS kernels take another path), so process mode was not bit-identical
    t = torch.randn(64, 32)
    frames = encode([t], kind=MessageKind.VALUE, seq=1, sender="w0", secret=SECRET)
    raw = bytearray(len(bytes(frames[2])) + 8)
    for off in (4, 8):
        shifted = memoryview(raw)[off : off + len(bytes(frames[2]))]
        shifted[:] = bytes(frames[2])
        got = decode([*frames[:2], shifted], secret=SECRET).body[0]
        assert got.data_ptr() % TENSOR_ALIGN == 0 and torch.equal(got, t)


def test_wrong_secret_is_rejected() -> None:
    frames = encode({"a": torch.ones(3)}, kind=MessageKind.BATCH, seq=1, sender="c", secret=SECRET)
    with pytest.raises(AuthenticationError):
        decode(frames, secret=secrets.token_bytes(32))


@pytest.mark.parametrize("frame_index", [0, 1, 2, 3])
def test_flipped_byte_in_any_frame_is_rejected(frame_index: int) -> None:
    body = {"a": torch.arange(10, dtype=torch.int64), "b": b"xyz", "c": [1, 2]}
    frames = [bytearray(f) for f in encode(body, kind=MessageKind.BATCH, seq=1, sender="c", secret=SECRET)]
    assert len(frames) == 4
    for pos in range(len(frames[frame_index])):
        tampered = [bytearray(f) for f in frames]
        tampered[frame_index][pos] ^= 0x01
        with pytest.raises((AuthenticationError, ProtocolError)):
            decode(tampered, secret=SECRET)
    decode(frames, secret=SECRET)  # the untouched copy still verifies


def test_structural_errors() -> None:
    frames = encode([b"ab"], kind=MessageKind.ACK, seq=1, sender="w", secret=SECRET)
    with pytest.raises(ProtocolError, match="truncated"):
        decode(frames[:2], secret=SECRET)
    with pytest.raises(ProtocolError, match="truncated"):
        decode([frames[0][:10]], secret=SECRET)
    with pytest.raises(AuthenticationError):
        decode([*frames[:2], frames[2] + b"!"], secret=SECRET)
    bad_magic = bytearray(frames[0])
    bad_magic[0:4] = b"XXXX"
    with pytest.raises(ProtocolError, match="magic"):
        verify([bad_magic, *frames[1:]], secret=SECRET)
    bad_version = bytearray(frames[0])
    bad_version[4:6] = (VERSION + 1).to_bytes(2, "big")
    with pytest.raises(ProtocolError, match="version"):
        decode([bad_version, *frames[1:]], secret=SECRET)


def test_unencodable_and_bad_secret() -> None:
    with pytest.raises(ProtocolError, match="object"):
        encode(object(), kind=MessageKind.BATCH, seq=1, sender="c", secret=SECRET)
    cyc: list[object] = []
    cyc.append(cyc)
    with pytest.raises(ProtocolError, match="deeper"):
        encode(cyc, kind=MessageKind.BATCH, seq=1, sender="c", secret=SECRET)
    with pytest.raises(InvalidSecretError):
        encode(1, kind=MessageKind.BATCH, seq=1, sender="c", secret=b"short")
    with pytest.raises(InvalidSecretError):
        encode(1, kind=MessageKind.BATCH, seq=1, sender="c", secret="x" * 40)  # type: ignore[arg-type]
    assert issubclass(InvalidSecretError, TransportError)


# --- hostile but correctly signed payloads (issue 18 g): a clear ProtocolError naming the sender ---------------


def _signed_payload(payload: bytes, *, sender: str = "w3") -> list[bytes]:
    from torch_dtorch.cluster.transport.wire import sign

    head = encode({}, kind=MessageKind.VALUE, seq=5, sender=sender, secret=SECRET)[0]
    head = bytes(head[: len(head) - 32])
    return [head + sign(head, [payload], secret=SECRET), payload]


@pytest.mark.parametrize("depth", [70, 5000, 200_000])
def test_deeply_nested_payload_is_a_protocol_error(depth: int) -> None:
    for opener, closer in ((b"[", b"]"), (b'{"t":[', b"]}")):
        with pytest.raises(ProtocolError, match=r"VALUE seq 5 from 'w3'.*nests deeper than 64"):
            decode(_signed_payload(opener * depth + closer * depth), secret=SECRET)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_standard_json_literals_are_refused(literal: bytes) -> None:
    with pytest.raises(
        ProtocolError, match=f"from 'w3'.*non-standard JSON literal {re.escape(literal.decode())}"
    ):
        decode(_signed_payload(b"[1, " + literal + b"]"), secret=SECRET)
    # the encoder never writes them: non-finite floats travel tagged and come back
    out = decode(
        encode([float("nan"), float("-inf")], kind=MessageKind.VALUE, seq=1, sender="c", secret=SECRET),
        secret=SECRET,
    )
    assert out.body[0] != out.body[0] and out.body[1] == float("-inf")


def test_oversized_payload_is_refused_before_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_dtorch.cluster.transport.wire as wire

    monkeypatch.setattr(wire, "MAX_PAYLOAD_BYTES", 4096)
    frames = _signed_payload(b"[" + b"1," * 4000 + b"1]")
    with pytest.raises(ProtocolError, match="over the limit of 4096"):
        decode(frames, secret=SECRET)
    monkeypatch.setenv("DTORCH_WIRE_MAX_PAYLOAD_BYTES", "12")
    with pytest.raises(ValueError, match="must be >= 1024"):
        wire._env_max_payload()


def test_receiver_reject_names_the_peer() -> None:
    from torch_dtorch.cluster.transport import Puller

    got: list[TransportError] = []
    import zmq

    with Puller(secret=SECRET, on_reject=got.append) as pull:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(pull.endpoint)
        try:
            push.send_multipart(_signed_payload(b"[NaN]", sender="w7"))
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                assert pull.recv(0.05) is None
        finally:
            push.close()
    assert len(got) == 1 and isinstance(got[0], ProtocolError)
    assert "from 'w7'" in str(got[0]) and "peer: sender 'w7' (unverified)" in str(got[0]), got
