"""How a worker compiles one compute segment of a loaded program on its first call (``backend/program.py``):
inductor on the segment's real inputs (static sizes; CUDA graphs with ``cudagraphs``), or — for a program of a graph
with symbolic sizes — inductor once for every size (``_compat.inductor_compile_symbolic``), with inductor's size
guards checked per call. Every segment function takes its inputs as one list, which it empties (the boxed calling
convention): a static-size segment's inductor code then drops each input after its last use, so the inputs the worker
donates (``program.py``: those the controller frees right after the call, e.g. a backward's saved activations) are
freed as the segment goes. ``loaded`` is ``program.py``'s record of the loaded program (its ``program``, ``fns``,
``cudagraphs``, ``static`` and ``name``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from torch_dtorch import _compat
from torch_dtorch.backend.local import Segment
from torch_dtorch.ops.decompositions import inductor_decompositions_for

__all__ = ["MAX_SYMBOLIC_VARIANTS", "boxed", "compile_segment"]

log = logging.getLogger(__name__)

_COMPILE_LOCK = threading.Lock()  # inductor is not re-entrant across worker threads


def boxed(fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """``fn`` (inputs positionally) as a segment function: takes one list and empties it."""

    def call(args: list[Any]) -> Any:
        xs = tuple(args)
        args.clear()
        return fn(*xs)

    return call


def compile_segment(
    loaded: Any, index: int, seg: Segment, args: Sequence[torch.Tensor]
) -> Callable[..., Any]:
    if loaded.program.sym_inputs:
        fn = _compile_symbolic_segment(loaded, seg, args)
        loaded.fns[index] = fn
        return fn
    mode = "reduce-overhead" if loaded.cudagraphs and args and args[0].is_cuda else None
    # the segment's inputs that are static program inputs (a program input's slot is its index)
    static = [i for i, s in enumerate(seg.in_slots) if s in loaded.static]
    with _COMPILE_LOCK:
        fn = _compat.inductor_compile(
            seg.gm,
            list(args),
            mode=mode,
            static_input_idxs=static,
            decompositions=inductor_decompositions_for(seg.gm, args),
            boxed=True,
        )
    loaded.fns[index] = fn
    return fn


#: compiled variants of one symbolic-size segment at most (each holds for the sizes its guard accepts)
MAX_SYMBOLIC_VARIANTS = 8


def _compile_symbolic_segment(loaded: Any, seg: Segment, args: Sequence[Any]) -> Callable[..., Any]:
    """A graph with symbolic sizes: inductor for every size where the graph's input sizes are plain symbols, else
    the graph as captured (logged once per program). Inductor's conditions on the sizes (a heuristic's bound) are
    checked at every call: sizes none of the compiled variants holds for compile another (up to
    :data:`MAX_SYMBOLIC_VARIANTS`; past that they run uncompiled)."""
    specs = loaded.program.sym_specs
    if not specs:
        log.info("%s runs uncompiled on device %d: an input size is not a plain symbol", loaded.name,
                 loaded.program.device)  # fmt: skip
        return seg.gm.forward  # type: ignore[no-any-return]
    eager = seg.gm.forward
    seg_specs = [specs[s] for s in seg.in_slots]
    decompositions = inductor_decompositions_for(seg.gm, args)
    variants: list[tuple[Callable[[Sequence[Any]], bool] | None, Callable[..., Any]]] = []
    failed: list[str] = []

    def compile_for(xs: list[Any]) -> Callable[..., Any] | None:
        try:
            with _COMPILE_LOCK:
                fn, guard = _compat.inductor_compile_symbolic(
                    seg.gm, seg_specs, xs, decompositions=decompositions
                )
        except Exception as e:  # noqa: BLE001 - the uncompiled graph computes the same
            log.debug("%s: inductor with symbolic sizes failed", loaded.name, exc_info=True)
            failed.append(f"{type(e).__name__}: {e}".splitlines()[0])
            log.info("%s runs uncompiled on device %d: %s", loaded.name, loaded.program.device, failed[0])
            return None
        variants.append((guard, fn))
        return fn

    def call(args: list[Any]) -> Any:
        xs = tuple(args)
        args.clear()
        # compiled for contiguous inputs (a KV cache may be a view)
        ys = [x.contiguous() if type(x) is torch.Tensor else x for x in xs]
        for guard, fn in variants:
            if guard is None or guard(ys):
                return fn(*ys)
        if not failed and len(variants) < MAX_SYMBOLIC_VARIANTS:
            new = compile_for(ys)
            if new is not None:
                return new(*ys)
        return eager(*xs)

    return call
