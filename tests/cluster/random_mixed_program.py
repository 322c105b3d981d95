"""Randomized programs that mix compiled calls with eager fast-path ops, for the process-mode wire.

:mod:`tests.cluster.random_program` makes eager programs only. A compiled program's own operands travel with its
``LoadProgram`` and are numbered in the same id space as eager operands (each compiled variant numbers its operands
from 0), so the worker processes' decoders see ids defined by a program and, later, by eager hit records: a bug of
that class (the decoder kept a program's operand for an id a later hit record made) is only reachable by mixing
both. The programs here interleave:

- the eager steps of :func:`~tests.cluster.random_program.eager_step` (chains of fast-path hits, binary ops, 0-d
  CPU scalars, in-place ops, frees, redistributes between Replicate, Shard(0) and Shard(1), fetches);
- aliasing views (``x[:]``, ``x.t().t()``, ...: in-place ops through either name change both), broadcasting views
  (``x + x[1:2]``) and fetches of views (``x.t()``, ``x[2:7]``);
- calls of small ``torch.compile(backend="dtorch")`` functions and modules of several kinds (pointwise, reductions
  and matmuls with redistributes inside, multi-output, a deep one with many operands, a 0-d CPU scalar input, a
  module with distributed parameters), on whole slots, transposed views or leading-row slices (written back with
  ``cat``); several alive at once, created mid-program and dropped mid-program (their programs unload:
  ``UnloadProgram`` travels too). Static shapes (``dynamic=False``) or ``dynamic=True``; under ``torch.no_grad()``,
  in grad mode, or with ``requires_grad`` leaves and a backward (the gradients are fetched).

Each compiled callable is made from source text compiled anew (its own code object), so dynamo's cache of one
callable can be dropped alone (:func:`torch._dynamo.eval_frame.reset_code`) and the callable garbage collected
(dynamo's cache entry lives in the code object, which the garbage collector does not traverse).

A program is a list of steps made from a seed alone (:func:`make_mixed_program`); :func:`run_mixed` runs it on a
dtorch mesh or on plain torch (``mesh=None``, the functions called uncompiled). Besides the program's fetches, every
value a slot drops (replaced or freed) is fetched, asynchronously, just before: a worker's error is sticky to the
operands it poisons and raises only when one of them is fetched, so no poisoned value goes unseen. Every fetched
value comes with whether it is *pointwise-exact*: computed by elementwise ops on shards only (no reduction over a
sharded dimension, no matmul), so dtorch agrees with torch up to the last bits of vectorized transcendental
functions (``tanh`` of a shard boundary element may take the scalar path).

Ill-conditioned steps would make the tolerances of the others meaningless: the compiled functions squash their
inputs with ``tanh`` first (the slots' values grow large through chains of ``x + 1``) and their iterations
contract, and a backward does not go through ``amax`` (its gradient jumps between maxima that tie in the last
bits).
"""

from __future__ import annotations

import gc
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import torch_dtorch as dt
from tests.cluster.random_program import SHAPE, SLOTS, apply_step, eager_step
from torch_dtorch import Replicate, Shard

__all__ = ["KINDS", "Kind", "Result", "make_mixed_program", "run_mixed"]


@dataclass(frozen=True)
class Kind:
    """A compiled callable: ``source`` defines ``f(*xs)`` or, for a module, a class ``M`` whose instance takes
    ``xs``; ``n_in`` slot inputs (a ``scalar`` kind takes a 0-d CPU tensor after them); its first output has the
    shape of its first input, the others (``n_out - 1``) are fetched at once; ``exact``: elementwise on shards."""

    name: str
    source: str
    n_in: int
    n_out: int = 1
    exact: bool = False
    scalar: bool = False
    module: bool = False
    #: the shapes it accepts: any 2-d (``"any"``) or ``(rows, 6)`` only (``"rows"``: a module's 6-feature weight)
    shapes: str = "any"


KINDS: list[Kind] = [
    Kind(
        "pointwise",
        "def f(x, y):\n    return torch.tanh(x * 0.5 + y) - y * y\n",
        n_in=2,
        exact=True,
    ),
    Kind(
        "norm",
        "def f(x):\n"
        "    a = torch.tanh(x)\n"
        "    a = a - a.mean(0, keepdim=True)\n"
        "    return a * torch.rsqrt((a * a).mean(1, keepdim=True) + 1.0), (a * a).sum(1), x.amax()\n",
        n_in=1,
        n_out=3,
    ),
    Kind(
        "attention",
        "def f(x, y):\n"
        "    y = torch.tanh(y)\n"
        "    s = torch.softmax((torch.tanh(x) @ y.t()) * 0.5, -1)\n"
        "    return torch.tanh(s @ y + x), s\n",
        n_in=2,
        n_out=2,
    ),
    Kind(
        # many operands of many shapes: its program's ids reach far into the eager ids that follow it
        "deep",
        "def f(x, y):\n"
        "    x, y = torch.tanh(x), torch.tanh(y)\n"
        "    for i in range(8):\n"
        "        h = torch.softmax((x @ y.t()) * 0.125, -1) @ y\n"
        "        m = (x * y).mean(1, keepdim=True)\n"
        "        x = torch.tanh(x * 0.5 + h * 0.25 - m * 0.125 + x.t().mean(1) * 0.0625)\n"
        "    return x, m\n",
        n_in=2,
        n_out=2,
    ),
    Kind(
        "scalar",
        "def f(x, y, s):\n    return torch.sigmoid(x * s) + y, (torch.tanh(x) * s).sum(0)\n",
        n_in=2,
        n_out=2,
        scalar=True,
    ),
    Kind(
        "module",
        "class M(torch.nn.Module):\n"
        "    def __init__(self, w, b, grad):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Parameter(w, requires_grad=grad)\n"
        "        self.b = torch.nn.Parameter(b, requires_grad=grad)\n"
        "    def forward(self, x, y):\n"
        "        return torch.tanh(torch.tanh(x) @ self.w + self.b) * y\n",
        n_in=2,
        module=True,
        shapes="rows",
    ),
]

#: the views a step may make of a slot: same shape (the slot becomes an alias of the other)
ALIASES: list[tuple[str, Callable[[Any], Any]]] = [
    ("slice_all", lambda x: x[:]),
    ("tt", lambda x: x.t().t()),
    ("view", lambda x: x.view(SHAPE)),
    ("unsqueeze", lambda x: x.unsqueeze(0)[0]),
]
#: ops on a view of the slot that keep its shape (elementwise, broadcasting the view)
BROADCASTS: list[tuple[str, Callable[[Any], Any]]] = [
    ("row", lambda x: x + x[1:2]),
    ("col", lambda x: x * x[:, 2:3]),
    ("select", lambda x: x - x[3]),
]
#: views fetched as they are
FETCH_VIEWS: list[tuple[str, Callable[[Any], Any]]] = [
    ("t", lambda x: x.t()),
    ("rows", lambda x: x[2:7]),
    ("cols", lambda x: x[:, 1:4]),
    ("row", lambda x: x[5]),
]

MODES = ("no_grad", "grad_mode", "requires_grad")
#: the steps that replace or free the slot named by their second item (``call``: its third)
_WRITES = frozenset({"init", "un", "bin", "chain", "scalar", "free", "move", "alias", "bcast"})
#: compiled callables alive at once, at most
MAX_ALIVE = 4


def make_mixed_program(
    seed: int,
    steps: int,
    *,
    dynamic: bool = False,
    modes: tuple[str, ...] = ("no_grad", "grad_mode"),
    kinds: tuple[str, ...] | None = None,
) -> list[tuple[Any, ...]]:
    """Steps (besides :func:`~tests.cluster.random_program.eager_step`'s, with placement codes 0: Replicate,
    1: Shard(0), 2: Shard(1)):

    - ``("new", fid, kind, mode, seed)``: compiled callable ``fid`` of ``KINDS[kind]`` (``mode`` in :data:`MODES`;
      ``seed``: a module's parameters, placed Replicate / Shard by the seed too);
    - ``("call", fid, dst, srcs, how, rows, scalar)``: ``dst = fid(*slots[srcs])``; ``how``: ``"whole"``, ``"t"``
      (called on ``x.t()`` views, the output transposed back: a view of the program's output) or ``"rows"`` (on
      ``x[:rows]``, written back as ``cat([out, slots[srcs[0]][rows:]])``); ``scalar``: the value of a scalar
      kind's 0-d CPU tensor (a new one each call);
    - ``("drop", fid)``: the callable and its dynamo cache dropped, garbage collected (its programs unload);
    - ``("alias", dst, src, k)``, ``("bcast", dst, src, k)``, ``("vfetch", src, k)``: :data:`ALIASES`,
      :data:`BROADCASTS`, :data:`FETCH_VIEWS`;
    - more ``("move", slot, code)`` than :func:`~tests.cluster.random_program.eager_step` makes: a redistribute
      names its input operand in a JSON instruction, where the decoder's operand table answers (the values of hit
      records are otherwise named by id in records only).

    Two callables are made and called right after the first slots exist (eager ids are small then: the programs'
    own ids are ahead of them; the first one is ``deep`` when static), more later, at most :data:`MAX_ALIVE` alive.
    Static callables (``dynamic=False``) are called in one way each (``how``: a new shape is a new dynamo graph);
    ``dynamic=True`` ones on whole slots or row slices of any length from 2."""
    rng = random.Random(seed)
    kind_ids = [i for i, k in enumerate(KINDS) if kinds is None or k.name in kinds]

    def place() -> int:
        return rng.randrange(3)

    prog: list[tuple[Any, ...]] = [("init", s, rng.randrange(1 << 30), place()) for s in range(SLOTS)]
    live = set(range(SLOTS))
    alive: dict[int, tuple[Kind, str]] = {}  # fid -> kind, how it is called (static)
    fids = itertools.count()

    def new(kind: int | None = None) -> int:
        fid = next(fids)
        k = rng.choice(kind_ids) if kind is None else kind
        prog.append(("new", fid, k, rng.choice(modes), rng.randrange(1 << 30)))
        how = rng.choice(("whole", "whole", "rows", "t"))
        alive[fid] = KINDS[k], "rows" if how == "t" and KINDS[k].shapes == "rows" else how
        return fid

    def call(fid: int) -> None:
        kind, how = alive[fid]
        srcs = tuple(rng.choice(sorted(live)) for _ in range(kind.n_in))
        rows = 5
        if dynamic:  # row slices of several lengths (2..8: a length of 1 would be specialized)
            how, rows = rng.choice(("whole", "rows", "rows")), rng.randrange(2, SHAPE[0] + 1)
        dst = rng.randrange(SLOTS)
        prog.append(("call", fid, dst, srcs, how, rows, rng.choice([0.25, -1.5, 2.0, 0.75])))
        live.add(dst)

    # two callables right away: their programs' ids are ahead of the eager ids for a while
    first = rng.sample(kind_ids, 2) if len(kind_ids) > 1 else kind_ids * 2
    if not dynamic and any(KINDS[k].name == "deep" for k in kind_ids):
        first[0] = next(k for k in kind_ids if KINDS[k].name == "deep")
    for k in first:
        call(new(k))
    for _ in range(steps):
        r = rng.random()
        if r < 0.7 or not live:
            eager_step(rng, prog, live, place=place, max_chain=16)
        elif r < 0.725:
            src = rng.choice(sorted(live))
            dst = rng.randrange(SLOTS)
            prog.append(("alias", dst, src, rng.randrange(len(ALIASES))))
            live.add(dst)
        elif r < 0.75:
            src = rng.choice(sorted(live))
            dst = rng.randrange(SLOTS)
            prog.append(("bcast", dst, src, rng.randrange(len(BROADCASTS))))
            live.add(dst)
        elif r < 0.77:
            prog.append(("vfetch", rng.choice(sorted(live)), rng.randrange(len(FETCH_VIEWS))))
        elif r < 0.85:
            prog.append(("move", rng.choice(sorted(live)), place()))
        elif r < 0.865 and len(alive) < MAX_ALIVE:
            new()
        elif r < 0.88 and len(alive) > 1:
            fid = rng.choice(sorted(alive))
            prog.append(("drop", fid))
            del alive[fid]
        elif alive:
            call(rng.choice(sorted(alive)))
        else:
            new()
    prog.extend(("fetch", s) for s in sorted(live))
    return prog


@dataclass
class Result:
    """The fetched values of a run, in program order (with ``fetch_all``, every value a slot dropped too), and
    whether each is pointwise-exact (see the module docstring)."""

    values: list[torch.Tensor]
    exact: list[bool]
    #: compiled callables dropped (and garbage collected) during the run
    dropped: int = 0


class _Run:
    """One run of a program: the slots, each slot's exactness, the live callables."""

    def __init__(self, mesh: dt.DeviceMesh | None, dynamic: bool, fetch_all: bool) -> None:
        self.mesh, self.dynamic, self.fetch_all = mesh, dynamic, fetch_all
        self.slots: dict[int, Any] = {}
        self.exact: dict[int, bool] = {}
        #: fid -> (kind, mode, callable, the code object dynamo caches it on)
        self.fns: dict[int, tuple[Kind, str, Any, Any]] = {}
        self.res = Result([], [])

    def to_device(self, t: torch.Tensor, code: int) -> Any:
        if self.mesh is None:
            return t.clone()
        return dt.distribute_tensor(t, self.mesh, [(Replicate(), Shard(0), Shard(1))[code]])

    def move(self, x: Any, code: int) -> Any:
        """A redistribute: a new tensor in dtorch, also to the placements ``x`` has (upstream's DTensor would alias
        ``x`` then), so writes through ``x``'s aliases do not reach it: a copy in torch."""
        if self.mesh is None:
            return x.clone()
        return x.redistribute(self.mesh, [(Replicate(), Shard(0), Shard(1))[code]])

    def fetch(self, x: Any, exact: bool) -> None:
        """Fetch ``x`` (started now, resolved at the end of the run: a value as of this point of the program)."""
        self.res.values.append(x.detach().clone() if self.mesh is None else dt.to_torch_async(x))
        self.res.exact.append(exact)

    def step(self, step: tuple[Any, ...]) -> None:
        """Run ``step``; the value a slot drops (replaced or freed) is fetched first: a worker's error is sticky to
        the operands it poisons and raises at their first fetch, and a dropped value is fetched no more."""
        kind, slots, exact = step[0], self.slots, self.exact
        target = step[2] if kind == "call" else step[1] if kind in _WRITES else None
        old = slots.get(target) if self.fetch_all and target is not None else None
        if old is not None:
            self.fetch(old, exact[target])
        self._step(step)
        del old

    def _step(self, step: tuple[Any, ...]) -> None:
        kind, slots, exact = step[0], self.slots, self.exact
        if kind == "fetch":
            self.fetch(slots[step[1]], exact[step[1]])
        elif kind == "new":
            self.new(*step[1:])
        elif kind == "call":
            self.call(*step[1:])
        elif kind == "drop":
            self.drop(step[1])
        elif kind == "alias":
            slots[step[1]] = ALIASES[step[3]][1](slots[step[2]])
            exact[step[1]] = exact[step[2]]
        elif kind == "bcast":
            slots[step[1]] = BROADCASTS[step[3]][1](slots[step[2]])
            exact[step[1]] = exact[step[2]]
        elif kind == "vfetch":
            self.fetch(FETCH_VIEWS[step[2]][1](slots[step[1]]), exact[step[1]])
        elif apply_step(step, slots, [], self.to_device, self.move, lambda x: x):
            if kind == "init":
                exact[step[1]] = True
            elif kind == "un":
                exact[step[1]] = exact[step[2]]
            elif kind == "bin":
                exact[step[1]] = exact[step[2]] and exact[step[3]]
        else:
            raise ValueError(f"unknown step {step!r}")

    def new(self, fid: int, k: int, mode: str, seed: int) -> None:
        spec = KINDS[k]
        scope: dict[str, Any] = {"torch": torch}
        # compiled anew: its own code object (the file name is unique), so its dynamo cache can be dropped alone
        exec(compile(spec.source, f"<mixed program: {spec.name} {fid}>", "exec"), scope)
        if spec.module:
            g = torch.Generator().manual_seed(seed)
            w, b = torch.randn(SHAPE[1], SHAPE[1], generator=g) * 0.5, torch.randn(SHAPE[1], generator=g)
            grad = mode == "requires_grad"
            fn = scope["M"](self.to_device(w, seed % 3), self.to_device(b, (seed >> 2) % 2), grad)
            code = type(fn).forward.__code__
        else:
            fn = scope["f"]
            code = fn.__code__
        if self.mesh is not None:
            fn = torch.compile(fn, backend="dtorch", dynamic=self.dynamic)
        self.fns[fid] = (spec, mode, fn, code)

    def call(self, fid: int, dst: int, srcs: tuple[int, ...], how: str, rows: int, scalar: float) -> None:
        spec, mode, fn, _code = self.fns[fid]
        xs = [self.slots[s] for s in srcs]
        ins = [x.t() for x in xs] if how == "t" else [x[:rows] for x in xs] if how == "rows" else list(xs)
        if mode == "requires_grad":
            ins = [x.detach().requires_grad_() for x in ins]
        if spec.scalar:
            ins.append(torch.tensor(scalar))
        with torch.no_grad() if mode == "no_grad" else torch.enable_grad():
            outs = fn(*ins)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        ok = spec.exact and all(self.exact[s] for s in srcs)
        if mode == "requires_grad":
            # (not through 0-d outputs: ``amax``'s gradient jumps between tied maxima, which differ in the last
            # bits of a reduced input)
            sum((o * o).sum() for o in outs if o.dim()).backward()
            params = list(fn.parameters()) if spec.module else []
            for x in [*ins[: spec.n_in], *params]:
                self.fetch(x.grad, False)
                x.grad = None
            outs = [o.detach() for o in outs]
        y = outs[0]
        if how == "t":
            y = y.t()  # a view of the program's output
        elif how == "rows" and rows < SHAPE[0]:
            y = torch.cat([y, xs[0][rows:]])
        for o in outs[1:]:
            self.fetch(o, ok)
        self.slots[dst] = y
        self.exact[dst] = ok

    def drop(self, fid: int) -> None:
        """Forget callable ``fid``: its dynamo cache entries (kept by its code object) go, then the garbage
        collector takes the compiled graphs (their variants' finalizers send ``UnloadProgram``)."""
        _spec, _mode, _fn, code = self.fns.pop(fid)
        del _fn
        if self.mesh is not None:
            torch._dynamo.eval_frame.reset_code(code)
        gc.collect()
        self.res.dropped += 1


def run_mixed(
    prog: list[tuple[Any, ...]],
    mesh: dt.DeviceMesh | None,
    *,
    dynamic: bool = False,
    fetch_all: bool = True,
) -> Result:
    """Run ``prog`` on ``mesh`` (``None``: plain torch, the callables uncompiled). ``dynamic``: how the callables
    are compiled (the program was made for it). ``fetch_all``: also fetch every value a slot drops (else only the
    program's fetches)."""
    run = _Run(mesh, dynamic, fetch_all)
    for step in prog:
        run.step(step)
    res = run.res
    res.values = [v if isinstance(v, torch.Tensor) else v.get() for v in res.values]
    return res
