"""Dynamo must not trace dtorch's own code: per-code frame strategies that run it as plain Python.

Wraps ``torch._C._dynamo.eval_frame`` (``_FrameAction``, ``_FrameExecStrategy``, ``set_code_exec_strategy``;
torch >= 2.7): they make dynamo's frame hook run a code object and its callees untraced, with nothing wrapped
around dtorch's functions. See :func:`hide_from_dynamo`.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)


#: torch_dtorch packages that hold model code (layers, model glue): dynamo traces them like user code
DYNAMO_VISIBLE = ("torch_dtorch.nn", "torch_dtorch.apps", "torch_dtorch.cli")
_HIDDEN_MODULES: set[str] = set()
_MAX_TABLE = 256


def _skip_strategy() -> Any:
    """``FrameExecStrategy(SKIP, SKIP)``: the eval-frame hook runs the frame, and every frame it calls, as plain
    Python (torch >= 2.7; ``None`` on a torch without per-code strategies)."""
    try:
        from torch._C._dynamo.eval_frame import (  # type: ignore[attr-defined]
            _FrameAction,
            _FrameExecStrategy,
        )
    except ImportError:
        return None
    return _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)


def _codes(roots: Iterable[Any], module: str) -> list[types.CodeType]:
    """The code objects defined in ``module`` reachable from ``roots`` (its globals): functions, class bodies,
    nested functions and lambdas (``co_consts``), and functions held in small module-level tables (kernel tables;
    large ones are registries filled at run time)."""
    out: list[types.CodeType] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(r, 0) for r in roots]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, (str, int, float, bool, type(None), torch._ops.OpOverload)) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.CodeType):
            out.append(obj)
            stack.extend((c, depth) for c in obj.co_consts if isinstance(c, types.CodeType))
        elif isinstance(obj, (staticmethod, classmethod)):
            stack.append((obj.__func__, depth))
        elif isinstance(obj, property):
            stack.extend((f, depth) for f in (obj.fget, obj.fset, obj.fdel) if f is not None)
        elif isinstance(obj, functools.partial):
            stack.append((obj.func, depth))
        elif isinstance(obj, (tuple, list, set, frozenset, dict)):
            if depth == 0 and len(obj) <= _MAX_TABLE:
                stack.extend((v, 1) for v in (obj.values() if isinstance(obj, dict) else obj))
        elif getattr(obj, "__module__", None) == module:
            code = getattr(obj, "__code__", None)
            if isinstance(code, types.CodeType):
                stack.append((code, depth))
            wrapped = getattr(obj, "__wrapped__", None)  # functools.wraps / cache
            if wrapped is not None:
                stack.append((wrapped, depth))
            if isinstance(obj, type):
                stack.extend((v, depth) for v in vars(obj).values())
    return out


def hide_from_dynamo(modules: Iterable[types.ModuleType] | None = None) -> int:
    """Make dynamo's frame hook run dtorch's own code as plain Python, and everything that code calls.

    Model code compiled with ``torch.compile`` runs eagerly around a graph break, with dynamo's frame hook still
    installed: every Python frame entered from there is a candidate for compilation, the ``dtorch`` device's
    dispatch kernels (called by the dispatcher for each op on a dtorch tensor) included. Dynamo then traced the
    fast path's bookkeeping as if it were model code and handed the backend graphs of integers. Each code object
    of the given modules (default: every loaded ``torch_dtorch`` module outside :data:`DYNAMO_VISIBLE`) gets the
    frame strategy ``(SKIP, SKIP)``: the frame and its callees run untraced, at no cost outside ``torch.compile``.
    Dynamo still inlines these functions where it traces model code that calls them (the strategy only governs
    frames the hook sees). Idempotent per module; returns the number of code objects marked (0 on a torch without
    per-code strategies)."""
    strategy = _skip_strategy()
    if strategy is None:
        return 0
    from torch._C._dynamo.eval_frame import set_code_exec_strategy  # type: ignore[attr-defined]

    if modules is None:
        modules = [
            m
            for name, m in list(sys.modules.items())
            if m is not None
            and (name == "torch_dtorch" or name.startswith("torch_dtorch."))
            and not name.startswith(DYNAMO_VISIBLE)
        ]
    marked = 0
    for m in modules:
        if m.__name__ in _HIDDEN_MODULES:
            continue
        _HIDDEN_MODULES.add(m.__name__)
        try:
            codes = _codes([v for k, v in vars(m).items() if not k.startswith("__")], m.__name__)
        except Exception:  # noqa: BLE001 - an odd module global must never break ``import torch_dtorch``
            log.debug("hide_from_dynamo: could not walk %s", m.__name__, exc_info=True)
            continue
        for code in codes:
            set_code_exec_strategy(code, strategy)
            marked += 1
    return marked
