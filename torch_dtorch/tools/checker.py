"""``TensorChecker``: register tensors by tag in two runs, compare them, dump the differences.

Typical use — the same model run twice (dtorch and plain torch, two dtorch layouts, before and after a change)::

    a, b = TensorChecker("dtorch"), TensorChecker("torch")
    a.register("block0.out", y_dt)  # a dtorch tensor: its global value is fetched (a sync point)
    b.register("block0.out", y_ref)  # a torch tensor or a numpy array
    report = a.compare(b, mode="allclose", rtol=1e-4, atol=1e-5, dump="first-not-equal", dump_dir="dumps")
    print(report)  # one line per tag, and the neighbourhood of the first differing element

Every registered value is stored as a detached CPU copy, so later in-place writes do not change it.

Comparison modes (``mode``):

- ``equal``: same shape, dtype and values (NaNs at the same places count as equal);
- ``allclose``: ``|a - b| <= atol + rtol * |b|`` elementwise (``torch.allclose``; NaNs equal);
- ``meanclose``: ``mean|a - b| <= atol + rtol * mean|b|`` — for long reductions where single elements may drift.

Dump modes (``dump``): ``none``, ``all`` (every tag), ``not-equal`` (every tag that fails), ``first-not-equal``
(the first failing tag, in registration order). A dump writes ``<dump_dir>/<run>/<tag>.npy`` for both runs.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torch_dtorch.errors import DTorchError

__all__ = ["CheckReport", "CheckResult", "TensorChecker", "TensorCheckError", "first_difference", "to_cpu"]

log = logging.getLogger(__name__)

MODES = ("equal", "allclose", "meanclose")
DUMP_MODES = ("none", "all", "not-equal", "first-not-equal")


class TensorCheckError(DTorchError, ValueError):
    """Bad arguments to a :class:`TensorChecker` (unknown mode, duplicate tag, unsupported value)."""


def to_cpu(value: Any) -> torch.Tensor:
    """A detached CPU copy of a torch tensor, a dtorch tensor (its global value) or a numpy array."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if not isinstance(value, torch.Tensor):
        raise TensorCheckError(f"TensorChecker: expected a tensor or numpy array, got {type(value).__name__}")
    from torch_dtorch.device.tensors import is_dtorch

    if is_dtorch(value):
        from torch_dtorch.api import to_torch

        return to_torch(value).detach().cpu().clone()
    return value.detach().to("cpu", copy=True)


@dataclass(frozen=True)
class CheckResult:
    """The comparison of one tag."""

    tag: str
    ok: bool
    max_abs_error: float
    max_rel_error: float
    mean_abs_error: float
    reason: str = ""
    #: index and values around the first differing element (empty when equal)
    neighbourhood: str = ""

    def line(self) -> str:
        status = "ok  " if self.ok else "DIFF"
        extra = f"  ({self.reason})" if self.reason else ""
        return (
            f"{status} {self.tag}: max abs {self.max_abs_error:.3g}, max rel {self.max_rel_error:.3g}, "
            f"mean abs {self.mean_abs_error:.3g}{extra}"
        )


@dataclass
class CheckReport:
    """Results of :meth:`TensorChecker.compare`, in registration order."""

    mode: str
    results: list[CheckResult] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    dumped: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and all(r.ok for r in self.results)

    @property
    def first_failure(self) -> CheckResult | None:
        return next((r for r in self.results if not r.ok), None)

    def __iter__(self) -> Iterator[CheckResult]:
        return iter(self.results)

    def __str__(self) -> str:
        lines = [
            f"TensorChecker ({self.mode}): {sum(r.ok for r in self.results)}/{len(self.results)} tags match"
        ]
        lines += [r.line() for r in self.results]
        if self.missing:
            lines.append(f"only in one run: {', '.join(self.missing)}")
        first = self.first_failure
        if first is not None and first.neighbourhood:
            lines.append(f"first difference in {first.tag}:")
            lines.append(first.neighbourhood)
        if self.dumped:
            lines.append(f"dumped {len(self.dumped)} files under {self.dumped[0].parent.parent}")
        return "\n".join(lines)


class TensorChecker:
    """Tensors of one run, registered by tag (insertion order kept).

    Args:
        name: the run's name (used as the dump sub-directory).
    """

    def __init__(self, name: str = "run") -> None:
        self.name = name
        self.tensors: dict[str, torch.Tensor] = {}

    def register(self, tag: str, value: Any, *, overwrite: bool = False) -> None:
        """Store a CPU copy of ``value`` under ``tag`` (a dtorch tensor is fetched: a sync point)."""
        if tag in self.tensors and not overwrite:
            raise TensorCheckError(
                f"TensorChecker {self.name!r}: tag {tag!r} registered twice (overwrite=True?)"
            )
        self.tensors[tag] = to_cpu(value)

    def __contains__(self, tag: str) -> bool:
        return tag in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def clear(self) -> None:
        self.tensors.clear()

    def compare(
        self,
        other: TensorChecker,
        *,
        mode: str = "allclose",
        rtol: float = 1e-5,
        atol: float = 1e-8,
        dump: str = "none",
        dump_dir: str | Path | None = None,
        window: int = 3,
    ) -> CheckReport:
        """Compare every tag both runs hold (``self`` is the run under test, ``other`` the reference)."""
        if mode not in MODES:
            raise TensorCheckError(f"TensorChecker.compare: mode {mode!r} is not one of {', '.join(MODES)}")
        if dump not in DUMP_MODES:
            raise TensorCheckError(
                f"TensorChecker.compare: dump {dump!r} is not one of {', '.join(DUMP_MODES)}"
            )
        if dump != "none" and dump_dir is None:
            raise TensorCheckError(f"TensorChecker.compare: dump={dump!r} needs dump_dir=")
        report = CheckReport(mode)
        report.missing = [t for t in self.tensors if t not in other.tensors]
        report.missing += [t for t in other.tensors if t not in self.tensors]
        dumped_failure = False
        for tag, a in self.tensors.items():
            b = other.tensors.get(tag)
            if b is None:
                continue
            res = compare_tensors(tag, a, b, mode=mode, rtol=rtol, atol=atol, window=window)
            report.results.append(res)
            if not res.ok:
                log.warning("TensorChecker: %s", res.line())
            want = dump == "all" or (not res.ok and dump == "not-equal")
            if not res.ok and dump == "first-not-equal" and not dumped_failure:
                want = dumped_failure = True
            if want:
                assert dump_dir is not None
                report.dumped += [_dump(Path(dump_dir), c.name, tag, t) for c, t in ((self, a), (other, b))]
        return report


def compare_tensors(
    tag: str, a: torch.Tensor, b: torch.Tensor, *, mode: str, rtol: float, atol: float, window: int = 3
) -> CheckResult:
    """Compare ``a`` (under test) with ``b`` (reference) under ``mode``."""
    if tuple(a.shape) != tuple(b.shape):
        return CheckResult(
            tag, False, math.inf, math.inf, math.inf, f"shape {list(a.shape)} vs {list(b.shape)}"
        )
    reason = ""
    if a.dtype != b.dtype:
        reason = f"dtype {_dt(a.dtype)} vs {_dt(b.dtype)}"
    af, bf = _as_float(a), _as_float(b)
    diff = (af - bf).abs()
    both_nan = af.isnan() & bf.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    diff = torch.where(diff.isnan(), torch.full_like(diff, math.inf), diff)
    scale = bf.abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    rel = diff / scale.clamp_min(torch.finfo(torch.float64).tiny)
    rel = torch.where(diff == 0, torch.zeros_like(rel), rel)
    max_rel = float(rel.max()) if rel.numel() else 0.0
    mean_abs = float(diff.mean()) if diff.numel() else 0.0
    if mode == "equal":
        bad = diff != 0
        ok = not bool(bad.any()) and a.dtype == b.dtype
    else:
        bad = diff > atol + rtol * scale
        if mode == "allclose":
            ok = not bool(bad.any())
        else:
            mean_scale = float(scale[~scale.isnan()].mean()) if scale.numel() else 0.0
            ok = mean_abs <= atol + rtol * mean_scale
    hood = "" if not bool(bad.any()) else first_difference(a, b, bad, window=window)
    return CheckResult(tag, ok, max_abs, max_rel, mean_abs, reason, hood)


def first_difference(a: torch.Tensor, b: torch.Tensor, bad: torch.Tensor, *, window: int = 3) -> str:
    """The index of the first ``True`` of ``bad`` and the values of ``a`` and ``b`` around it along the last dim."""
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    idx = tuple(int(i) for i in np.unravel_index(flat, tuple(a.shape))) if a.ndim else ()
    if a.ndim == 0:
        return f"  at []: {a.item()!r} vs {b.item()!r}"
    last = idx[-1]
    lo, hi = max(0, last - window), min(a.shape[-1], last + window + 1)
    head = idx[:-1]
    row_a, row_b, row_bad = a[head][lo:hi], b[head][lo:hi], bad[head][lo:hi]
    cols = []
    for j in range(hi - lo):
        mark = "*" if bool(row_bad[j]) else " "
        cols.append(f"{mark}[{lo + j}] {_fmt(row_a[j])} vs {_fmt(row_b[j])}")
    where = ", ".join(map(str, head))
    prefix = f"[{where}, {lo}:{hi}]" if head else f"[{lo}:{hi}]"
    return f"  first at {list(idx)}; neighbourhood {prefix} (under test vs reference, * = differs):\n    " + (
        "\n    ".join(cols)
    )


def _fmt(x: torch.Tensor) -> str:
    v = x.item()
    return f"{v:.7g}" if isinstance(v, float) else repr(v)


def _as_float(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        return torch.view_as_real(t).to(torch.float64)
    return t.to(torch.float64)


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _dump(root: Path, run: str, tag: str, t: torch.Tensor) -> Path:
    folder = root / _SAFE.sub("_", run)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_SAFE.sub('_', tag)}.npy"
    value = t.float() if t.dtype == torch.bfloat16 else t
    np.save(path, value.numpy())
    log.info("TensorChecker: dumped %s", path)
    return path
