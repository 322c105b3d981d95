"""Dtype errors at the call, like torch eager: ``int @ float``, ``bool & float``, ``int // 0``, ...

Shape inference runs each op on meta tensors, and meta kernels check shapes, not dtypes: ``mm`` of ``int64`` and
``float32`` meta tensors, ``bitwise_and`` of floats or an integer ``// 0`` all "succeed" there, so the error used to
surface only at the next fetch, far from the line that caused it. :func:`check_dtypes` closes that gap for the
families where such errors live (pointwise and matmul-like ops): on the full (planning) path it runs the op once on
real 1-element CPU tensors (``torch.ones`` with each operand's dtype and number of dims; every non-tensor argument
and constant as given) and re-raises torch's own error, with torch's type and message, naming the op and its
operands. Size-1 dims broadcast with anything and ``ones`` divide anything, so a call torch accepts is never refused.

What it does **not** catch: value-dependent errors (an integer division by a *tensor* holding zeros: the divisor's
values live on the workers; that error is raised at the next fetch, as before) and dtypes the CPU cannot probe
(float8, unsigned 16/32/64-bit, complex32, quantized: not probed, so CUDA-only kernels are never refused). The
eager fast path replays only calls that succeeded once, so it needs no check; results are cached per (op, input
dtypes and ranks, constants).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from torch_dtorch.graph import Operand
from torch_dtorch.placement_rules import OpCall, OpRule
from torch_dtorch.placement_rules.call import map_operands

__all__ = ["PROBED_FAMILIES", "check_dtypes"]

log = logging.getLogger(__name__)

#: rule families whose dtype errors meta tensors miss (and which a 1-element probe represents faithfully)
PROBED_FAMILIES = frozenset({"pointwise", "matmul"})
_UNPROBED_DTYPES = frozenset(
    d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
    and (d.is_floating_point and d.itemsize == 1 or d in (torch.uint16, torch.uint32, torch.uint64))
) | frozenset(
    d
    for name in ("complex32", "quint8", "qint8", "qint32", "quint4x2", "quint2x4")
    if isinstance(d := getattr(torch, name, None), torch.dtype)
)
_PASSED: set[Any] = set()
_MAX_PASSED = 8192


def _const(v: Any) -> Any:
    t = type(v)
    if t is tuple or t is list:
        return tuple([_const(x) for x in v])
    if t is dict:
        return tuple(sorted((k, _const(x)) for k, x in v.items()))
    if isinstance(v, Operand):
        return (v.dtype, len(v.shape))
    if isinstance(v, torch.Tensor):  # a constant (e.g. a wrapped Python number)
        if v.numel() == 1 and v.device.type == "cpu" and not v.requires_grad:
            return ("T", v.dtype, tuple(v.shape), v.item())
        return ("T", v.dtype, tuple(v.shape), id(v))
    hash(v)
    return v


def _key(call: OpCall) -> Any:
    try:
        return (call.op, _const(call.args), _const(call.kwargs))
    except TypeError:  # an unhashable argument: probe every time
        return None


def _probe(o: Operand) -> torch.Tensor:
    return torch.ones((1,) * len(o.shape), dtype=o.dtype)


def _probed(op: Any) -> bool:
    """Not random ops (the probe would draw from the CPU generator) and not ops whose arguments bound the
    values (``mvlgamma``: every element above ``(p - 1) / 2``; a probe of ones could be refused)."""
    tags = getattr(op, "tags", ())
    name = getattr(op, "__name__", str(op))
    return torch.Tag.nondeterministic_seeded not in tags and not name.startswith("mvlgamma")


def check_dtypes(rule: OpRule, call: OpCall) -> None:
    """Raise torch's own error now if ``call`` fails on its operands' dtypes (see the module docstring)."""
    if rule.family not in PROBED_FAMILIES or not _probed(call.op):
        return
    inputs = call.present()
    if not inputs or any(o.dtype in _UNPROBED_DTYPES for o in inputs):
        return
    key = _key(call)
    if key is not None and key in _PASSED:
        return
    args, kwargs = map_operands((call.args, call.kwargs), _probe)
    try:
        with torch.no_grad():
            call.op(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError, ZeroDivisionError) as e:
        described = "\n".join(f"    {x.describe()}" for x in inputs)
        msg = f"{e}\n  (dtorch: {call.op} refused at the call, as torch does, with arguments:\n{described})"
        try:
            err: BaseException = type(e)(msg)
        except Exception:  # noqa: BLE001 - an exception type with another constructor
            err = RuntimeError(msg)
        raise err from None
    except Exception as e:  # noqa: BLE001 - anything else is the probe's problem, not the user's: let it through
        log.debug("dtype probe of %s failed oddly (%r); not checked", call.op, e)
        return
    if key is not None:
        if len(_PASSED) >= _MAX_PASSED:
            _PASSED.clear()
        _PASSED.add(key)
