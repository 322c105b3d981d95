"""Options of the ``dtorch`` / ``dtorch_debug`` backends: ``torch.compile(m, backend="dtorch", options={...})``.

| option | meaning | default |
|---|---|---|
| ``worker_compiler`` | how each worker runs its local program: ``"eager"`` (the FX program as is) or ``"inductor"`` (each compute segment between collectives compiled by inductor on the worker, at its first call) | ``"eager"`` |
| ``cudagraphs`` | CUDA workers: capture each inductor-compiled compute segment in a CUDA graph (needs ``worker_compiler="inductor"``) | ``False`` |
| ``redistribute`` | redistribute policy for placement propagation (``"auto"``, ``"local"``, ``"never"``; see ``DTORCH_REDISTRIBUTE``) | ``DTORCH_REDISTRIBUTE`` |
| ``decompositions`` | extra aten overloads to decompose during capture, on top of the small built-in table | ``()`` |
| ``reports`` | a list: every compiled variant appends its :class:`~torch_dtorch.backend.report.CompileReport` (the three graphs) | ``None`` |
| ``file`` | ``dtorch_debug`` only: where the three graphs are written: any object with ``write``, or a path (``str`` / ``os.PathLike``: each report is appended to that file) | ``sys.stdout`` |
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_dtorch.config import RedistributePolicy

__all__ = ["CompileOptions", "CompileOptionsError", "FileSink", "check_cudagraph_devices"]

_WORKER_COMPILERS = ("eager", "inductor")


class CompileOptionsError(ValueError):
    """``options={...}`` given to ``torch.compile(backend="dtorch")`` holds an unknown key or a bad value."""


@dataclass(frozen=True)
class FileSink:
    """``options={"file": path}``: each report is appended to ``path`` (opened for each write, so nothing stays
    open between compiles)."""

    path: Path

    def write(self, text: str) -> int:
        with self.path.open("a", encoding="utf-8") as f:
            return f.write(text)


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    worker_compiler: str = "eager"
    cudagraphs: bool = False
    redistribute: RedistributePolicy | None = None
    decompositions: tuple[Any, ...] = ()
    reports: list[Any] | None = field(default=None, compare=False)
    file: Any = field(default=None, compare=False)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None, *, backend: str) -> CompileOptions:
        """Validate ``options`` (``None``: defaults); raise :class:`CompileOptionsError` naming the fix."""
        raw = dict(options or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CompileOptionsError(
                f"torch.compile(backend={backend!r}): unknown option(s) {unknown}; known options: {sorted(known)} "
                "(see docs/compile.md)"
            )
        wc = raw.get("worker_compiler", "eager")
        if wc not in _WORKER_COMPILERS:
            raise CompileOptionsError(
                f"torch.compile(backend={backend!r}): worker_compiler={wc!r}; use one of {list(_WORKER_COMPILERS)}"
            )
        cudagraphs = bool(raw.get("cudagraphs", False))
        if cudagraphs and wc != "inductor":
            raise CompileOptionsError(
                f"torch.compile(backend={backend!r}): cudagraphs=True needs worker_compiler='inductor' (CUDA graphs "
                "capture the inductor-compiled compute segments of each worker's program)"
            )
        policy = raw.get("redistribute")
        if policy is not None:
            try:
                policy = RedistributePolicy(str(policy))
            except ValueError:
                valid = [p.value for p in RedistributePolicy]
                raise CompileOptionsError(
                    f"torch.compile(backend={backend!r}): redistribute={policy!r}; use one of {valid}"
                ) from None
        decomps = raw.get("decompositions", ())
        if not isinstance(decomps, Sequence) or isinstance(decomps, str):
            raise CompileOptionsError(
                f"torch.compile(backend={backend!r}): decompositions must be a list of aten overloads, "
                f"got {type(decomps).__name__}"
            )
        reports = raw.get("reports")
        if reports is not None and not isinstance(reports, list):
            raise CompileOptionsError(
                f"torch.compile(backend={backend!r}): reports must be a list (the backend appends to it), "
                f"got {type(reports).__name__}"
            )
        out = raw.get("file")
        if isinstance(out, (str, os.PathLike)):
            path = Path(out)
            if not path.parent.is_dir() or path.is_dir():
                raise CompileOptionsError(
                    f"torch.compile(backend={backend!r}): file={str(out)!r} is not a writable file path (its "
                    "directory must exist)"
                )
            out = FileSink(path)
        elif out is not None and not hasattr(out, "write"):
            raise CompileOptionsError(
                f"torch.compile(backend={backend!r}): file must be a path (str or os.PathLike) or have a write() "
                f"method, got {type(out).__name__}"
            )
        return cls(
            worker_compiler=wc,
            cudagraphs=cudagraphs,
            redistribute=policy,
            decompositions=tuple(decomps),
            reports=reports,
            file=out,
        )


def check_cudagraph_devices(
    options: CompileOptions, torch_devices: Mapping[int, Any], *, backend: str
) -> None:
    """``cudagraphs=True`` needs one rank per GPU: raise ``NotImplementedError`` when several ranks of a program
    (``torch_devices``: rank -> its torch device) are virtual ranks on one GPU. One rank capturing a CUDA graph
    cannot overlap another rank's device-wide synchronization on the same GPU (CUDA rejects it with
    ``cudaErrorStreamCaptureUnsupported``), and ranks synchronize around every collective."""
    if not options.cudagraphs:
        return
    by_gpu: dict[str, list[int]] = {}
    for rank, dev in torch_devices.items():
        if getattr(dev, "type", None) == "cuda":
            by_gpu.setdefault(str(dev), []).append(rank)
    shared = {gpu: ranks for gpu, ranks in by_gpu.items() if len(ranks) > 1}
    if shared:
        gpu, ranks = next(iter(shared.items()))
        raise NotImplementedError(
            f"torch.compile(backend={backend!r}, options={{'cudagraphs': True}}): ranks {ranks} of this program are "
            f"virtual ranks on one GPU ({gpu}, a simulated mesh); CUDA graphs need one rank per GPU, because one "
            "rank's graph capture cannot overlap another rank's device synchronization on the same GPU. Fix: drop "
            "cudagraphs=True on simulated meshes (worker_compiler='inductor' alone works there), or run on a "
            "1-device mesh or on distinct GPUs"
        )
