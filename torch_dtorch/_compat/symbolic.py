"""Symbolic sizes of traced graphs (:mod:`torch_dtorch.backend`): a ``torch.SymInt``'s sympy expression and hint.

Wraps ``SymInt.node`` (the ``SymNode``'s ``expr`` and ``hint``), which has no public accessor.
"""

from __future__ import annotations

from typing import Any

import torch


def sym_expr(s: Any) -> Any:
    """The sympy expression of a ``torch.SymInt`` (its ``SymNode``'s ``expr``; 2.11–2.13 alike); anything else (an
    ``int``, a sympy expression) as is."""
    return s.node.expr if isinstance(s, torch.SymInt) else s


def sym_hint(s: Any) -> int:
    """The concrete value a ``torch.SymInt`` had when traced (the shape env's hint); an ``int`` as is."""
    if isinstance(s, int):
        return s
    hint = s.node.hint
    if hint is None:
        raise ValueError(f"symbolic size {s} has no hint (a data-dependent size)")
    return int(hint)
