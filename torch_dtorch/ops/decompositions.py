"""Decompositions of dtorch's registered ops for the workers' inductor: the op's arithmetic as traceable aten ops.

A ``torch.library`` custom op is opaque to inductor: compiled, it stays one extern call whose body runs as it would
eagerly (its own kernels, none fused with the ops around it). A family that can say what its op computes in plain
aten ops registers that here (:func:`register_inductor_decomposition`); when a worker (or the plain-input path)
hands inductor a graph that calls the op, :func:`inductor_decompositions_for` gives the decompositions of the ops
the graph calls, inductor adds them to its own table (``_compat.inductor_compile(decompositions=...)``) and
lowers — and fuses — the op's arithmetic with the rest of the graph.

Each decomposition comes with the devices it applies on (``when``): the fp8 linear decomposes into the fp8 GEMM only
where its kernel would run that GEMM (Hopper-class GPUs), and stays whole — its float emulation — elsewhere. An op
in the table must be decomposed (inductor refuses an op it has both a decomposition and a fallback for), so the
choice is made for the whole graph, from the device of its inputs, before inductor traces it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import fx

__all__ = [
    "Decomposition",
    "DevicePredicate",
    "graph_device",
    "inductor_decompositions_for",
    "register_inductor_decomposition",
]

#: ``(*args, **kwargs) -> result``, traced by inductor in place of the op
Decomposition = Callable[..., Any]
#: ``(device) -> bool``: whether the decomposition applies to a graph whose inputs are on ``device``
DevicePredicate = Callable[[torch.device], bool]

_TABLE: dict[Any, tuple[Decomposition, DevicePredicate]] = {}
_LOCK = threading.Lock()


def _any_device(device: torch.device) -> bool:
    return True


def register_inductor_decomposition(
    ops: Iterable[Any], *, when: DevicePredicate = _any_device
) -> Callable[[Decomposition], Decomposition]:
    """Decorator: ``fn`` is what inductor traces in place of each of ``ops`` (OpOverloads) in a graph on a device
    ``when`` accepts."""

    def register(fn: Decomposition) -> Decomposition:
        with _LOCK:
            for op in ops:
                _TABLE[op] = (fn, when)
        return fn

    return register


def graph_device(example_inputs: Sequence[Any]) -> torch.device:
    """The device a worker's graph runs on: its first accelerator input's, else the CPU."""
    devices = [a.device for a in example_inputs if isinstance(a, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


def inductor_decompositions_for(
    gm: fx.GraphModule, example_inputs: Sequence[Any]
) -> dict[Any, Decomposition] | None:
    """The registered decompositions of the ops ``gm`` calls that apply on its inputs' device; ``None`` where there
    is none (inductor then compiles with its own table alone, as before)."""
    with _LOCK:
        if not _TABLE:
            return None
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in _TABLE}
        entries = {t: _TABLE[t] for t in targets}
    if not entries:
        return None
    device = graph_device(example_inputs)
    found = {op: fn for op, (fn, when) in entries.items() if when(device)}
    return found or None
