"""Randomized eager programs for the process-mode wire: interleaved chains of small ops (most of them fast-path
hits, so they travel as binary hit records), frees, in-place ops, ``x + x``, 0-d CPU scalars, redistributes and
fetches.

A program is a list of steps made from a seed alone (:func:`make_program`), so the same program runs on any
backend: :func:`run_dtorch` on a dtorch mesh (thread or process mode) and :func:`run_torch` on plain tensors. Both
return every fetched value in order. Pointwise ops on shards are bit-identical to the global op, so dtorch results
must *equal* torch's.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Self

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard

__all__ = ["apply_step", "eager_step", "make_program", "run_dtorch", "run_torch"]

SHAPE = (8, 6)
SLOTS = 6

#: (name, arity, fn) of the ops a step may apply; each keeps the shape, so any slot can feed any op
UNARY: list[tuple[str, Callable[[Any], Any]]] = [
    ("mul_half", lambda x: x * 0.5),
    ("add_1", lambda x: x + 1.0),
    ("neg", lambda x: -x),
    ("sigmoid", torch.sigmoid),
    ("tanh", torch.tanh),
    ("clamp", lambda x: x.clamp(-2.0, 2.0)),
    ("square", lambda x: x * x),  # one operand in two slots: JSON in process mode, replayed by the workers
]
BINARY: list[tuple[str, Callable[[Any, Any], Any]]] = [
    ("add", lambda x, y: x + y),
    ("sub", lambda x, y: x - y),
    ("mul", lambda x, y: x * y),
    ("maximum", torch.maximum),
    ("addcmul", lambda x, y: torch.addcmul(x, x, y, value=0.25)),
]


def make_program(seed: int, steps: int) -> list[tuple[Any, ...]]:
    """Steps: ``("init", slot, seed, shard)``, ``("un", dst, src, k)``, ``("bin", dst, a, b, k)``,
    ``("chain", slot, k, n)`` (n repeats of one unary op: a run of hit records), ``("inplace", slot)``,
    ``("free", slot)``, ``("move", slot, shard)`` (redistribute), ``("scalar", slot, v, n)`` (n steps of
    ``tanh(x * torch.tensor(v * i)) + x``: a plain 0-d CPU tensor with a new value each time) and
    ``("fetch", slot)``."""
    rng = random.Random(seed)
    prog: list[tuple[Any, ...]] = [
        ("init", s, rng.randrange(1 << 30), rng.random() < 0.5) for s in range(SLOTS)
    ]
    live = set(range(SLOTS))
    for _ in range(steps):
        eager_step(rng, prog, live)
    prog.extend(("fetch", s) for s in sorted(live))
    return prog


def eager_step(
    rng: random.Random,
    prog: list[tuple[Any, ...]],
    live: set[int],
    *,
    place: Callable[[], Any] | None = None,
    max_chain: int = 40,
) -> None:
    """Append one random eager step to ``prog`` (``live``: the slots holding a tensor, updated). ``place``: draws
    the placement code of an ``init`` or ``move`` (default: Shard(0) or Replicate, ``True`` / ``False``);
    ``max_chain``: chains are shorter than this."""
    place = place or (lambda: rng.random() < 0.5)
    r = rng.random()
    if not live:
        s = rng.randrange(SLOTS)
        prog.append(("init", s, rng.randrange(1 << 30), place()))
        live.add(s)
        return
    src = rng.choice(sorted(live))
    dst = rng.randrange(SLOTS)
    if r < 0.3:
        prog.append(("un", dst, src, rng.randrange(len(UNARY))))
        live.add(dst)
    elif r < 0.55:
        prog.append(("bin", dst, src, rng.choice(sorted(live)), rng.randrange(len(BINARY))))
        live.add(dst)
    elif r < 0.75:
        prog.append(("chain", src, rng.randrange(len(UNARY) - 1), rng.randrange(2, max_chain)))
        if rng.random() < 0.25:
            prog.append(("scalar", src, rng.choice([0.25, -0.5, 0.125]), rng.randrange(1, 6)))
    elif r < 0.8:
        prog.append(("inplace", src))
    elif r < 0.88:
        prog.append(("free", src))
        live.discard(src)
    elif r < 0.93:
        prog.append(("move", src, place()))
    else:
        prog.append(("fetch", src))


def _init(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g)


def apply_step(
    step: tuple[Any, ...],
    slots: dict[int, Any],
    out: list[torch.Tensor],
    make: Callable[[torch.Tensor, Any], Any],
    move: Callable[[Any, Any], Any],
    fetch: Callable[[Any], torch.Tensor],
) -> bool:
    """Run one step of :func:`make_program` on ``slots`` (fetched values appended to ``out``); ``False``: a step
    of another kind (left to the caller)."""
    kind = step[0]
    if kind == "init":
        slots[step[1]] = make(_init(step[2]), step[3])
    elif kind == "un":
        slots[step[1]] = UNARY[step[3]][1](slots[step[2]])
    elif kind == "bin":
        slots[step[1]] = BINARY[step[4]][1](slots[step[2]], slots[step[3]])
    elif kind == "chain":
        x, fn = slots[step[1]], UNARY[step[2]][1]
        for _ in range(step[3]):
            x = fn(x)
        slots[step[1]] = x
    elif kind == "scalar":
        x = slots[step[1]]
        for i in range(step[3]):
            x = (x * torch.tensor(step[2] * (i + 1))).tanh() + x
        slots[step[1]] = x
    elif kind == "inplace":
        slots[step[1]].mul_(0.75).add_(0.125)
    elif kind == "free":
        del slots[step[1]]  # the last reference: the workers free its blobs (a Free record)
    elif kind == "move":
        slots[step[1]] = move(slots[step[1]], step[2])
    elif kind == "fetch":
        out.append(fetch(slots[step[1]]))
    else:
        return False
    return True


def _run(
    prog: list[tuple[Any, ...]],
    make: Callable[[torch.Tensor, Any], Any],
    move: Callable[[Any, Any], Any],
    fetch: Callable[[Any], torch.Tensor],
) -> list[torch.Tensor]:
    slots: dict[int, Any] = {}
    out: list[torch.Tensor] = []
    for step in prog:
        if not apply_step(step, slots, out, make, move, fetch):
            raise ValueError(f"unknown step {step!r}")
    return out


def run_torch(prog: list[tuple[Any, ...]]) -> list[torch.Tensor]:
    return _run(prog, lambda t, _s: t.clone(), lambda x, _s: x, lambda x: x.clone())


def run_dtorch(prog: list[tuple[Any, ...]], mesh: dt.DeviceMesh) -> list[torch.Tensor]:
    def placements(shard: bool) -> list[Any]:
        return [Shard(0)] if shard and mesh.size() > 1 else [Replicate()]

    return _run(
        prog,
        lambda t, s: dt.distribute_tensor(t, mesh, placements(s)),
        lambda x, s: x.redistribute(mesh, placements(s)),
        lambda x: x.full_tensor(),
    )


class Counting:
    """Counts the hit-record words and JSON instructions of every batch the runner encodes."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.words = 0
        self.batches = 0
        self._encode = runner._encoder.encode

    def see(self, batch: Any) -> None:
        """Look at each batch before it is encoded (subclasses count instructions)."""

    def __enter__(self) -> Self:
        def encode(batch: Any) -> Any:
            self.see(batch)
            tree = self._encode(batch)
            self.batches += 1
            self.words += len(tree[7] or b"") // 8
            return tree

        self.runner._encoder.encode = encode  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.runner._encoder.encode
