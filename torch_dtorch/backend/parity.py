"""What inductor compiles, counted: the tool behind ``bench/compile_parity.py`` and the parity test.

``backend="dtorch"`` on a 1-device mesh should hand inductor the graph plain ``torch.compile`` would: the same ops
after inductor's own passes, the same inputs treated as static (parameters), and so the same generated kernels.
:class:`InductorCapture` records, for every graph inductor lowers while it is active — in any thread, so the
workers' compiles too — the post-grad FX graph, the generated wrapper code and what the compile decided about the
inputs; :func:`code_counts` / :func:`totals` reduce them to the counts that separate two compiles (kernel
launches, extern calls, pure copy kernels, allocated buffers), and :func:`side_by_side` prints two runs next to
each other. Counts, not times: they are exact on the CPU, where nothing can be timed that matters on a GPU.
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

__all__ = ["CodeCounts", "InductorCapture", "InductorGraph", "code_counts", "side_by_side", "totals"]

#: ops that only move or reinterpret data: a kernel fused from these alone is a copy
_COPY_OPS = frozenset(
    [
        "clone",
        "copy",
        "to_copy",
        "contiguous",
        "view",
        "reshape",
        "unsafe_view",
        "permute",
        "transpose",
        "t",
        "expand",
        "squeeze",
        "unsqueeze",
        "slice",
        "select",
        "as_strided",
        "cat",
    ]
)
_KERNEL_DEF = re.compile(r"^(\w+) = async_compile\.(?:triton|cpp_pybinding|cpp|cuda|mps)\(", re.M)
_EXTERN = re.compile(r"\bextern_kernels\.(\w+)\(")
_FALLBACK = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_BUFFER = re.compile(r"\bempty_strided(?:_\w+)?\(")
_INPUT = re.compile(r"\bassert_size_stride\(\w+, .*'input'\)")


@dataclass
class CodeCounts:
    """What one generated wrapper runs per call."""

    kernels: int = 0  #: launches of generated (triton / C++) kernels
    kernel_defs: int = 0  #: distinct generated kernels
    copy_kernels: int = (
        0  #: launches of generated kernels made only of copy / layout ops (``*_fused_clone_3``)
    )
    extern: collections.Counter[str] = field(
        default_factory=collections.Counter
    )  #: mm, addmm, bmm, ... calls
    fallback: collections.Counter[str] = field(
        default_factory=collections.Counter
    )  #: aten ops inductor calls
    buffers: int = 0  #: ``empty_strided`` allocations
    copies: int = 0  #: explicit ``.copy_`` / ``.clone()`` calls in the wrapper
    inputs: int = 0  #: inputs the wrapper checks (``assert_size_stride``)


@dataclass
class InductorGraph:
    """One graph inductor lowered: post-grad op counts, the wrapper's code and the input decisions."""

    thread: str
    ops: collections.Counter[str]
    code: str
    num_inputs: int = 0
    static_inputs: int = (
        0  #: inputs inductor treats as static (parameters: not alignment-checked, not copied)
    )
    checked_inputs: int = 0  #: inputs whose alignment is checked (and fixed by a copy) at every call (GPU)

    @property
    def counts(self) -> CodeCounts:
        return code_counts(self.code)


def _is_copy_kernel(name: str) -> bool:
    """``triton_poi_fused_clone_3`` / ``cpp_fused_permute_view_1``: every fused op a copy or layout op."""
    if "fused_" not in name:
        return False
    rest = re.sub(r"_\d+$", "", name.split("fused_", 1)[1])
    ops = sorted(_COPY_OPS, key=len, reverse=True)
    while rest:
        rest = rest.lstrip("_")
        hit = next((op for op in ops if rest == op or rest.startswith(op + "_")), None)
        if hit is None:
            return False
        rest = rest[len(hit) :]
    return True


def code_counts(code: str) -> CodeCounts:
    """Count what the generated wrapper ``code`` does per call (CPU and CUDA wrappers alike)."""
    c = CodeCounts()
    names = set(_KERNEL_DEF.findall(code))
    c.kernel_defs = len(names)
    body = code.split("def call(", 1)[-1]
    if names:
        launch = re.compile(r"^\s+(" + "|".join(map(re.escape, sorted(names))) + r")(?:\.run)?\(", re.M)
        for m in launch.finditer(body):
            c.kernels += 1
            c.copy_kernels += _is_copy_kernel(m.group(1))
    c.extern.update(_EXTERN.findall(body))
    c.fallback.update(f"{ns}.{op}" for ns, op, _ in _FALLBACK.findall(body))
    c.buffers = len(_BUFFER.findall(body))
    c.copies = body.count(".copy_(") + body.count(".clone()")
    c.inputs = len(_INPUT.findall(body))
    return c


class InductorCapture:
    """Records every graph inductor lowers while active (any thread); FX graph caching is off meanwhile, so each
    compile really generates its code. ``graphs``: one :class:`InductorGraph` per compiled graph, in order."""

    def __init__(self) -> None:
        self.graphs: list[InductorGraph] = []
        self._lock = threading.Lock()
        self._local = threading.local()
        self._stack: Any = None

    @contextmanager
    def _patched(self) -> Iterator[None]:
        from torch._inductor import compile_fx as cfx
        from torch._inductor import config
        from torch._inductor.graph import GraphLowering

        capture = self
        init = GraphLowering.__init__
        check = cfx.get_input_idxs_to_check

        def lowering_init(lowering: Any, gm: Any, *args: Any, **kwargs: Any) -> None:
            init(lowering, gm, *args, **kwargs)
            if type(lowering) is GraphLowering and kwargs.get("const_module") is None:
                capture._local.ops = collections.Counter(
                    _op_name(n.target) for n in gm.graph.nodes if n.op == "call_function"
                )

        def input_idxs_to_check(inputs: Sequence[Any], static_input_idxs: Sequence[int]) -> Sequence[int]:
            out = check(inputs, static_input_idxs)
            capture._local.inputs = (len(inputs), len(set(static_input_idxs)), len(out))
            return out

        def save_output_code(code: str) -> None:
            local = capture._local
            ops = getattr(local, "ops", None)
            n, static, checked = getattr(local, "inputs", (0, 0, 0))
            local.ops = None
            graph = InductorGraph(
                threading.current_thread().name, ops or collections.Counter(), code, n, static, checked
            )
            with capture._lock:
                capture.graphs.append(graph)

        with (
            mock.patch.object(GraphLowering, "__init__", lowering_init),
            mock.patch.object(GraphLowering, "save_output_code", staticmethod(save_output_code)),
            mock.patch.object(cfx, "get_input_idxs_to_check", input_idxs_to_check),
            config.patch(force_disable_caches=True),
        ):
            yield

    def __enter__(self) -> InductorCapture:
        self._stack = self._patched()
        self._stack.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.__exit__(*exc)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


#: post-grad ops that copy data (a graph-level ``contiguous`` is a ``clone``)
COPY_OPS = ("aten.clone.default", "aten.copy_.default", "aten.copy.default", "aten._to_copy.default")


def totals(graphs: Sequence[InductorGraph]) -> dict[str, int]:
    """The counts of several compiled graphs (one run), summed: the rows of :func:`side_by_side`."""
    out: collections.Counter[str] = collections.Counter()
    out["graphs"] = len(graphs)
    for g in graphs:
        c = g.counts
        out["post-grad ops"] += sum(v for k, v in g.ops.items() if k != "getitem")
        out["post-grad copies (clone/copy_/_to_copy)"] += sum(g.ops[k] for k in COPY_OPS)
        out["kernel launches"] += c.kernels
        out["distinct kernels"] += c.kernel_defs
        out["copy-only kernel launches"] += c.copy_kernels
        out["extern calls"] += sum(c.extern.values())
        for k, v in c.extern.items():
            out[f"  extern {k}"] += v
        out["aten fallback calls"] += sum(c.fallback.values())
        for k, v in c.fallback.items():
            out[f"  fallback {k}"] += v
        out["buffers (empty_strided)"] += c.buffers
        out["wrapper copies (.copy_/.clone)"] += c.copies
        out["inputs"] += g.num_inputs
        out["static inputs"] += g.static_inputs
        out["inputs alignment-checked per call"] += g.checked_inputs
    return dict(out)


def side_by_side(
    a: dict[str, int], b: dict[str, int], names: tuple[str, str] = ("inductor", "dtorch")
) -> str:
    """Two :func:`totals` as a table, with the difference ``b - a`` (``!`` marks the rows that differ)."""
    keys = list(a) + [k for k in b if k not in a]
    width = max(len(k) for k in keys) + 2
    lines = [f"{'':<{width}}{names[0]:>10}{names[1]:>10}{'diff':>8}"]
    for k in keys:
        x, y = a.get(k, 0), b.get(k, 0)
        mark = "  !" if x != y else ""
        lines.append(f"{k:<{width}}{x:>10}{y:>10}{y - x:>+8}{mark}")
    return "\n".join(lines)


def op_diff(a: Sequence[InductorGraph], b: Sequence[InductorGraph]) -> dict[str, tuple[int, int]]:
    """Post-grad ops whose counts differ between two runs: ``{op: (count in a, count in b)}``."""
    ca: collections.Counter[str] = collections.Counter()
    cb: collections.Counter[str] = collections.Counter()
    for g in a:
        ca.update(g.ops)
    for g in b:
        cb.update(g.ops)
    return {k: (ca[k], cb[k]) for k in sorted(set(ca) | set(cb)) if ca[k] != cb[k]}
