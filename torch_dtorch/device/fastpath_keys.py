"""The eager fast path's keys (:mod:`torch_dtorch.device.fastpath`): interned layouts, constant keys, stride patterns.

A layout — (mesh, placements, shape, stride, dtype) of one operand — is interned once as a small int (kept on the
tensor table entry), so a hit hashes a short tuple of ints and tagged constants. A gapped operand's layout also maps
to the id of its stride pattern (:data:`PATTERN_OF`), the key non-view ops' templates are shared under.
"""

from __future__ import annotations

import itertools
from typing import Any

from torch import Tensor

from torch_dtorch.device import binding, dispatch
from torch_dtorch.graph import Operand
from torch_dtorch.graph.strides import is_dense, stride_key
from torch_dtorch.mesh import current_mesh
from torch_dtorch.placement import Replicate
from torch_dtorch.placement_rules.rule import number_key

__all__ = [
    "CONST",
    "MISS",
    "PATTERN_OF",
    "SCALAR",
    "bind_unbound",
    "constant_key",
    "intern_layout",
    "fresh_dense",
    "is_scalar_upload",
    "layout_of",
    "pattern_key",
    "stats",
]

#: returned by a fast path's ``__call__`` when the call must take the full path
MISS: Any = object()
#: hits / misses / templates recorded (for tests and benchmarks; the native kernel's hits and misses included)
stats = {"hit": 0, "miss": 0, "recorded": 0}

#: the tag of a constant argument's key entry
CONST = "const"
#: the key's tag of a plain 0-d CPU tensor argument (with its dtype; never its value)
SCALAR = "cpu-0d"

_LAYOUTS: dict[tuple[Any, ...], int] = {}
_LAYOUT_IDS = itertools.count(1)
_MAX_LAYOUTS = 1 << 16


def layout_of(x: Operand) -> int:
    """A small int standing for ``x``'s (mesh, placements, shape, stride, dtype). Ids are never reused.

    A gapped operand's id (strides not dense: ``ids[:, -1:]`` of a growing ``[B, L]``, strides ``(L, 1)``) also
    maps to the id of its stride *pattern* (:data:`PATTERN_OF`, :func:`~torch_dtorch.graph.strides.stride_key`),
    under which the templates of non-view ops are kept too (see :func:`pattern_key`)."""
    return intern_layout(x.mesh, x.placements, x.shape, x.stride, x.dtype)


def intern_layout(
    mesh: Any, placements: Any, shape: tuple[int, ...], stride: tuple[int, ...] | None, dtype: Any
) -> int:
    """:func:`layout_of` from the fields (a template's outputs before their operands exist)."""
    key = (mesh, placements, shape, stride, dtype)
    lid = _LAYOUTS.get(key)
    if lid is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()  # old ids stay unique: templates keyed by them simply stop matching
            PATTERN_OF.clear()
        lid = _LAYOUTS[key] = next(_LAYOUT_IDS)
        if stride and not is_dense(shape, stride):
            pkey = (mesh, placements, shape, stride_key(shape, stride), dtype)
            pid = _LAYOUTS.get(pkey)
            if pid is None:
                pid = _LAYOUTS[pkey] = next(_LAYOUT_IDS)
            PATTERN_OF[lid] = pid
    return lid


#: layout id of a gapped operand -> the id of its stride pattern (shared by every raw stride of that pattern)
PATTERN_OF: dict[int, int] = {}


def bind_unbound(
    rt: Any, first: Operand | None, unbound: list[tuple[int, int, Operand]], key: list[Any], targs: list[Any]
) -> Operand | None:
    """Materialize the unbound operands of a call at ``targs[i]`` on the mesh the full path would pick (the first
    bound input's, else the innermost ``with mesh:``, else the last op's) and put their layouts at ``key[k]``.
    Returns the first tensor input; ``None``: no mesh in sight (the full path decides)."""
    mesh = first.mesh if first is not None else current_mesh() or rt.last_mesh
    if mesh is None:
        return None
    for i, k, x in unbound:
        y = binding.bind(rt, x, mesh)
        targs[i] = y
        key[k] = layout_of(y)
    return next(a for a in targs if isinstance(a, Operand))


def constant_key(a: Any) -> tuple[Any, ...]:
    """The key of one constant argument. Tagged by type: a constant must never equal a layout id (ints) or another
    type's value (``1 == 1.0 == True``: ``x + 1`` and ``x + 1.0`` promote differently); a float equal to another is
    the same float except zeros (``0.0 == -0.0``) and NaNs (``nan != nan``): those by their bits."""
    t = type(a)
    if (t is float and not (a and a == a)) or t is complex:
        return (CONST, number_key(a))
    return (CONST, t, a)


def pattern_key(key: list[Any]) -> tuple[Any, ...] | None:
    """``key`` with the layout of every gapped input replaced by its stride pattern's (``None``: no gapped input).
    A fresh result's layout depends on its inputs' strides only through the comparisons the pattern keeps
    (``torch_dtorch/graph/strides.py``), so a non-view op's template learned for one raw stride serves every
    stride of the pattern; a view's outputs carry its input's strides, so views are keyed by raw strides only
    (the caller's guard)."""
    if not PATTERN_OF:
        return None
    pattern = PATTERN_OF
    alt = [pattern.get(k, k) if type(k) is int else k for k in key]
    return tuple(alt) if alt != key else None


def fresh_dense(outputs: list[Operand]) -> bool:
    """Every output is dense (a fresh result of gapped inputs is, by torch's stride rules: checked, not assumed)."""
    return all(o.stride is None or is_dense(o.shape, o.stride) for o in outputs)


def is_scalar_upload(x: Operand | None, t: Tensor) -> bool:
    """``x`` is what the full path made of the plain 0-d tensor ``t``: a Replicate 0-d operand of its dtype."""
    return (
        x is not None
        and x.mesh is not None
        and x.shape == ()
        and x.dtype == t.dtype
        and all(type(p) is Replicate for p in x.placements)
    )


def full_path(rt: Any, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """A miss: ``op`` on the full path. Returns its result and the constructor's record of the call (its
    ``last_call``), or ``None`` when the call recorded no operator of ``op`` (it decomposed or went elsewhere)."""
    stats["miss"] += 1
    constructor = rt.executor.constructor
    before = constructor.last_call
    out = dispatch.dispatch_op(op, args, kwargs)
    last = constructor.last_call
    return out, (None if last is None or last is before or last.op is not op else last)


def keep(cache: dict[Any, Any], key: Any, template: Any, *, limit: int) -> Any:
    """``cache[key] = template``; a cache at ``limit`` templates starts again empty (a long run of new shapes)."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = template
    return template
