"""Shared pieces of the batch codec: errors, the registry of custom instruction codecs, op names, constants."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torch_dtorch.errors import DTorchError, NoRuleError
from torch_dtorch.executor.instructions import Barrier, Fetch, Free, Redistribute, RunOp, Upload
from torch_dtorch.graph import Operand
from torch_dtorch.placement import Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.placement_rules.redistribute import steps as _steps
from torch_dtorch.placement_rules.rule import number_key

if TYPE_CHECKING:
    from torch_dtorch.cluster.codec.decoder import DecodeContext
    from torch_dtorch.cluster.codec.encoder import EncodeContext

log = logging.getLogger(__name__)

MAGIC = "dtorch-codec"
#: 2: binary hit records (``codec/hits.py``) in a frame of their own, after the JSON payload; 3: records for
#: views, list arguments and the Python fast path's hits too (a v2 worker refused their hit templates)
VERSION = 3
#: operands kept by both sides before the oldest are forgotten (at the start of a batch)
MAX_OPERANDS = 1 << 16
#: entries of a metadata table (templates, operand types, ...) before it is cleared (at the start of a batch)
MAX_TABLE = 1 << 13
#: entries of an encoder's identity index (keyed by ``id()`` of objects the controller reuses) before it is
#: cleared. Each entry keeps its objects alive and every upload or redistribute makes fresh ones, so this bounds
#: the controller's memory in a long run (~0.3 KiB per entry); hot entries come back at their next use.
MAX_FAST = 1 << 11
#: the tables both sides keep, in the order they are named in a batch's ``cleared`` list
TABLES = ("op", "mesh", "otype", "tmpl", "hit")


class CodecError(DTorchError, ValueError):
    """An instruction batch could not be encoded or decoded: unknown tag or op overload, a value of an
    unsupported type, a format version mismatch, or batches decoded out of order."""


CUSTOM: dict[str, tuple[type, Callable[[Any, Any], Any], Callable[[Any, Any], Any]]] = {}
CUSTOM_BY_TYPE: dict[type, str] = {}
BUILTIN_TAGS = {"R": RunOp, "X": Redistribute, "U": Upload, "F": Fetch, "D": Free, "B": Barrier}


def register_codec(
    cls: type,
    *,
    tag: str,
    encode: Callable[[Any, EncodeContext], Any],
    decode: Callable[[Any, DecodeContext], Any],
) -> None:
    """Teach the codec an instruction type of a higher layer (e.g. the compile backend's ``RunProgram``).

    ``encode(instr, ctx)`` returns a tree (use ``ctx.operand`` / ``ctx.value`` / ``ctx.mesh`` / ``ctx.op`` for
    operands, constants, meshes and op overloads, so they share the session's tables); ``decode(tree, ctx)`` rebuilds
    the instruction with the matching ``ctx`` methods, visiting the parts **in the same order** as ``encode``.
    Worker processes must import the registering module before decoding. Registering a tag or a type twice raises
    :class:`CodecError`."""
    if not isinstance(tag, str) or not tag or tag in BUILTIN_TAGS:
        raise CodecError(
            f"register_codec({cls.__name__}): tag {tag!r} is empty or a built-in tag {sorted(BUILTIN_TAGS)}"
        )
    if tag in CUSTOM or cls in CUSTOM_BY_TYPE or cls in BUILTIN_TAGS.values():
        raise CodecError(
            f"register_codec({cls.__name__}, tag={tag!r}): the tag or the type is already registered "
            f"(tags: {sorted(CUSTOM)}); pick another tag or register once"
        )
    CUSTOM[tag] = (cls, encode, decode)
    CUSTOM_BY_TYPE[cls] = tag


def op_name(op: Any) -> str:
    if isinstance(op, str):
        return op
    name = op.name()  # "aten::add.Tensor"; the default overload has no suffix
    return name if "." in name.split("::")[-1] else name + ".default"


def resolve_op(name: Any) -> Any:
    if not isinstance(name, str):
        raise CodecError(
            f"bad op reference {name!r}: expected a qualified overload name like 'aten::add.Tensor'"
        )
    op: Any = name
    if "::" in name:
        ns, _, rest = name.partition("::")
        packet_name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(getattr(torch.ops, ns), packet_name), overload or "default")
        except (AttributeError, RuntimeError) as e:
            raise CodecError(
                f"unknown op overload {name!r}: this worker's torch has no such operator ({e}); "
                "controller and workers must run the same torch and load the same extensions"
            ) from None
    try:
        rule = get_rule(op)
    except NoRuleError:
        raise CodecError(
            f"unknown op overload {name!r}: no placement rule is registered for it on this worker; "
            "import the module that registers it (register_rule) in the worker process"
        ) from None
    return op, rule


TORCH_CONSTS: dict[str, Any] = {}
for _v in list(vars(torch).values()):
    if isinstance(_v, (torch.dtype, torch.layout, torch.memory_format)):
        TORCH_CONSTS[str(_v).removeprefix("torch.")] = _v
CONST_TAG = {torch.dtype: "dt", torch.layout: "ly", torch.memory_format: "mf"}
STEP_TYPES: dict[str, type] = {
    c.__name__: c
    for c in (
        _steps.AllGather,
        _steps.AllReduce,
        _steps.AllToAll,
        _steps.LocalSlice,
        _steps.PointToPoint,
        _steps.ReduceScatter,
        _steps.ZeroFill,
    )
}


def pl_str(placements: Sequence[Placement]) -> str:
    out = []
    for p in placements:
        t = type(p)
        if t is Shard:
            out.append(f"S({p.dim})")  # type: ignore[attr-defined]
        elif t is Replicate:
            out.append("R")
        elif t is Partial:
            out.append(f"P({p.reduce_op})")  # type: ignore[attr-defined]
        else:
            raise CodecError(f"cannot encode placement {p!r}: only Shard, Replicate and Partial travel")
    return "".join(out)


class Slot:
    """Placeholder of input slot ``k`` in a decoded template's args."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k


def nonfinite_body(v: float) -> str:
    """A NaN or infinity as the hex of its 8 IEEE bytes: a NaN's sign and payload survive (``repr`` gives ``nan``
    for both signs, and ``copysign``/``signbit`` tell them apart)."""
    return struct.pack("<d", v).hex()


def nonfinite_from_body(body: str) -> float:
    """:func:`nonfinite_body` read back (``"nan"``/``"inf"``/``"-inf"`` from an older encoder too)."""
    if len(body) == 16:
        return float(struct.unpack("<d", bytes.fromhex(body))[0])
    return float(body)


_END = object()


def template_key(a: Any, key: list[Any], inputs: list[Operand | None]) -> bool:
    """Append a hashable, type-exact stand-in of one argument to ``key`` (operands: their input slot); False if
    it cannot be cached (tensor constants are mutable, other types are encoded by value each time). Keys the
    encoder's templates and the hit templates of the Python fast path's hits."""
    t = type(a)
    if t is tuple or t is list:
        key.append(t)
        for x in a:
            tx = type(x)
            if tx is Operand:
                try:
                    k = inputs.index(x)  # identity: operands compare by identity
                except ValueError:
                    return False
                key.append(Slot)
                key.append(k)
            elif tx is int or tx is str or tx is bool or x is None:
                key.append(tx)
                key.append(x)
            elif not template_key(x, key, inputs):
                return False
        key.append(_END)
    elif t is Operand:
        try:
            k = inputs.index(a)
        except ValueError:
            return False
        key.append(Slot)
        key.append(k)
    elif t is int or t is str or t is bool or a is None:
        key.append(t)
        key.append(a)
    elif t is float or t is complex:
        key.append(number_key(a))  # by bits: tells -0.0 and the signs of NaNs apart
    elif t is dict:
        key.append(dict)
        for k, v in a.items():
            key.append(k)
            if not template_key(v, key, inputs):
                return False
        key.append(_END)
    elif t in CONST_TAG or t is torch.device or t is torch.Size:
        key.append(t)
        key.append(a)
    else:
        return False
    return True
