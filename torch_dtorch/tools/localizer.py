"""Mismatch localizer: find where a dtorch model's outputs start to differ from its plain torch twin.

Coarse to fine:

1. **Module level** — :func:`localize_mismatch` runs the dtorch model and its torch twin (same weights, same input)
   with a forward hook on every submodule, and compares each call's outputs. The first module *to finish* (hooks
   fire when a module returns, so a leaf finishes before its parent) whose outputs differ beyond ``rtol``/``atol``
   is where the error appears first; its input/output placements and the max error are reported.
2. **Op level** — the inputs that module received in the dtorch run are kept; its ``forward`` runs once more under
   a :class:`~torch_dtorch.tools.recorder.GraphRecorder` that fetches every operator's input and output values.
   Each recorded operator (an intercepted aten overload, or a redistribute) is then replayed on plain torch with
   the *dtorch* input values, so an error does not propagate: the first operator whose output differs from torch's
   answer on the same inputs is the culprit (a wrong rule, a wrong local kernel, a wrong redistribute).

Use it on tiny models: values are fetched after every module and, in step 2, after every operator.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from torch_dtorch.executor.future import TensorFuture
from torch_dtorch.graph import Operand
from torch_dtorch.graph.printer import format_operator
from torch_dtorch.tools.checker import CheckResult, compare_tensors
from torch_dtorch.tools.recorder import GraphRecorder, RecordedOp

__all__ = ["MismatchReport", "ModuleMismatch", "OpMismatch", "localize_mismatch", "localize_op"]

log = logging.getLogger(__name__)

_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ModuleMismatch:
    """The first module call whose outputs differ."""

    name: str
    call: int  # which call of this module (0 for the first)
    order: int  # position in completion order among all module calls
    output_index: int  # which tensor of the (flattened) output differs first
    max_abs_error: float
    max_rel_error: float
    input_placements: tuple[str, ...]
    output_placements: tuple[str, ...]
    neighbourhood: str = ""

    def __str__(self) -> str:
        suffix = f" (call {self.call})" if self.call else ""
        return (
            f"module {self.name or '<root>'}{suffix}: output {self.output_index} differs, "
            f"max abs error {self.max_abs_error:.3g} (rel {self.max_rel_error:.3g})\n"
            f"  inputs:  {', '.join(self.input_placements) or '-'}\n"
            f"  outputs: {', '.join(self.output_placements) or '-'}"
        )


@dataclass(frozen=True)
class OpMismatch:
    """The first operator inside the module whose output differs from torch on the same inputs."""

    op: str
    line: str  # the LogicalGraph line: operands, placements, output type
    index: int  # position among the module's recorded operators
    max_abs_error: float
    max_rel_error: float
    neighbourhood: str = ""

    def __str__(self) -> str:
        return (
            f"op #{self.index} {self.op}: max abs error {self.max_abs_error:.3g} (rel {self.max_rel_error:.3g})\n"
            f"  {self.line}"
        )


@dataclass
class MismatchReport:
    """What :func:`localize_mismatch` found (``module`` is ``None`` when every module matched)."""

    module: ModuleMismatch | None
    op: OpMismatch | None = None
    modules_checked: int = 0
    ops_checked: int = 0
    #: the LogicalGraph of the module's re-run (one line per operator), when step 2 ran
    graph: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.module is None

    def __str__(self) -> str:
        if self.module is None:
            return f"no mismatch: {self.modules_checked} module calls match the torch twin"
        lines = [f"first mismatch after {self.modules_checked} module calls:", str(self.module)]
        if self.module.neighbourhood:
            lines.append(self.module.neighbourhood)
        if self.op is not None:
            lines += [f"inside it ({self.ops_checked} operators replayed on torch):", str(self.op)]
            if self.op.neighbourhood:
                lines.append(self.op.neighbourhood)
        lines += self.notes
        if self.graph:
            lines += ["module graph:", *("  " + ln for ln in self.graph.splitlines())]
        return "\n".join(lines)


@dataclass
class _Call:
    name: str
    call: int
    module: nn.Module
    args: Any = None
    kwargs: Any = None
    parent: _Call | None = None
    inputs: list[Any] = field(default_factory=list)  # futures / tensors
    outputs: list[Any] = field(default_factory=list)  # futures / tensors
    in_pl: tuple[str, ...] = ()
    out_pl: tuple[str, ...] = ()


class _Tracer:
    """Forward hooks on every submodule recording each call's outputs in completion order."""

    def __init__(self, model: nn.Module, *, dtorch: bool) -> None:
        self.dtorch = dtorch
        self.calls: list[_Call] = []
        self._counts: dict[str, int] = {}
        self._stack: list[_Call] = []
        self._handles: list[Any] = []
        for name, mod in model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post()))

    def _pre(self, name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, kwargs: Any) -> None:
            k = self._counts.get(name, 0)
            self._counts[name] = k + 1
            c = _Call(name, k, mod, parent=self._stack[-1] if self._stack else None)
            tensors = _tensors((args, kwargs))
            if self.dtorch:
                c.args, c.kwargs = args, kwargs
                c.in_pl = tuple(_placement_str(t) for t in tensors)
                c.inputs = [_fetch_async(t) for t in tensors]
            else:
                c.inputs = [t.detach().to("cpu", copy=True) for t in tensors]
            self._stack.append(c)

        return hook

    def _post(self) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any, output: Any) -> None:
            c = self._stack.pop()
            tensors = _tensors(output)
            if self.dtorch:
                c.out_pl = tuple(_placement_str(t) for t in tensors)
                c.outputs = [_fetch_async(t) for t in tensors]
            else:
                c.outputs = [t.detach().to("cpu", copy=True) for t in tensors]
            self.calls.append(c)

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def localize_mismatch(
    dt_model: nn.Module,
    torch_model: nn.Module,
    inputs: Sequence[Any],
    *,
    dt_inputs: Sequence[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    dt_kwargs: dict[str, Any] | None = None,
    mesh: Any = None,
    placements: Sequence[Any] | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    op_level: bool = True,
) -> MismatchReport:
    """Run both models on one input and name the first module (then operator) where they differ.

    Args:
        dt_model: the dtorch-parallelized model.
        torch_model: its plain torch twin with the same weights (same module names).
        inputs: positional inputs of the torch twin (torch tensors; ``kwargs`` for keyword inputs).
        dt_inputs: inputs of the dtorch model (``dt_kwargs``); default: ``inputs`` distributed on ``mesh`` with
            ``placements`` (Replicate by default).
        rtol, atol: the ``allclose`` tolerance of every comparison.
        op_level: also localize the operator inside the first differing module (step 2).
    """
    kwargs = dict(kwargs or {})
    if dt_inputs is None:
        if mesh is None:
            raise ValueError("localize_mismatch: give dt_inputs= or a mesh= to distribute the inputs on")
        from torch_dtorch.api import distribute_tensor

        dt_inputs = [
            distribute_tensor(x, mesh, placements) if isinstance(x, torch.Tensor) else x for x in inputs
        ]
        dt_kwargs = {
            k: distribute_tensor(v, mesh, placements) if isinstance(v, torch.Tensor) else v
            for k, v in kwargs.items()
        }
    ref = _Tracer(torch_model, dtorch=False)
    try:
        with torch.no_grad():
            torch_model(*inputs, **kwargs)
    finally:
        ref.remove()
    got = _Tracer(dt_model, dtorch=True)
    try:
        with torch.no_grad():
            dt_model(*dt_inputs, **(dt_kwargs or {}))
    finally:
        got.remove()
    expected = {(c.name, c.call): c for c in ref.calls}
    report = MismatchReport(None)
    tol = {"rtol": rtol, "atol": atol}
    for order, c in enumerate(got.calls):
        r = expected.get((c.name, c.call))
        if r is None:
            report.notes.append(
                f"note: {c.name} (call {c.call}) has no counterpart in the torch twin; skipped"
            )
            continue
        report.modules_checked += 1
        bad = _first_difference(c.outputs, r.outputs, c.name, tol)
        if bad is None:
            continue
        # a module whose inputs already differ is not the origin: the code of the module that called it (between
        # its children) produced them, so go up to the innermost caller whose inputs still match
        culprit, index, res = c, bad[0], bad[1]
        while culprit.parent is not None:
            twin = expected.get((culprit.name, culprit.call))
            if twin is None or _first_difference(culprit.inputs, twin.inputs, culprit.name, tol) is None:
                break
            report.notes.append(
                f"note: {culprit.name or '<root>'} already received different inputs; the difference comes from "
                f"the code of {culprit.parent.name or '<root>'} that runs before it"
            )
            culprit = culprit.parent
            twin = expected.get((culprit.name, culprit.call))
            if twin is not None:
                found = _first_difference(culprit.outputs, twin.outputs, culprit.name, tol)
                if found is not None:
                    index, res = found
        report.module = ModuleMismatch(
            culprit.name, culprit.call, order, index, res.max_abs_error, res.max_rel_error, culprit.in_pl,
            culprit.out_pl, res.neighbourhood,
        )  # fmt: skip
        log.info("localize_mismatch: %s", report.module)
        if op_level:
            localize_op(culprit.module, culprit.args, culprit.kwargs, report, rtol=rtol, atol=atol)
        return report
    return report


def _first_difference(
    got: list[Any], want: list[torch.Tensor], name: str, tol: dict[str, float]
) -> tuple[int, CheckResult] | None:
    """Index and comparison of the first of ``got`` (futures or tensors) that differs from ``want``."""
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        res = compare_tensors(
            f"{name}[{i}]", _resolve(a), b, mode="allclose", rtol=tol["rtol"], atol=tol["atol"]
        )
        if not res.ok:
            return i, res
    if len(got) != len(want):
        res = CheckResult(
            f"{name}", False, math.inf, math.inf, math.inf, f"{len(got)} vs {len(want)} tensors"
        )
        return min(len(got), len(want)), res
    return None


def localize_op(
    module: nn.Module,
    args: Any,
    kwargs: Any,
    report: MismatchReport | None = None,
    *,
    rtol: float = 1e-4,
    atol: float = 1e-5,
) -> MismatchReport:
    """Re-run ``module.forward(*args, **kwargs)`` (dtorch inputs) under a fetching recorder and replay every
    operator on torch with the dtorch input values; fills ``report.op`` with the first that differs."""
    report = report if report is not None else MismatchReport(None)
    with GraphRecorder(fetch=True) as rec, torch.no_grad():
        module.forward(*args, **(kwargs or {}))
    report.graph = rec.format()
    for index, r in enumerate(rec.ops):
        report.ops_checked += 1
        found = _check_op(index, r, rtol=rtol, atol=atol, notes=report.notes)
        if found is not None:
            report.op = found
            log.info("localize_mismatch: %s", found)
            break
    return report


def _check_op(index: int, r: RecordedOp, *, rtol: float, atol: float, notes: list[str]) -> OpMismatch | None:
    node = r.node
    ins = [_resolve(f) if f is not None else None for f in r.inputs]
    outs = [_resolve(f) if f is not None else None for f in r.outputs]
    if any(o is None for o in outs) or any(v is None and x is not None for v, x in zip(ins, node.inputs)):
        notes.append(f"note: op #{index} {node.name}: some values are not on a mesh; not replayed")
        return None
    try:
        expected = _replay(node, ins)
    except Exception as e:  # noqa: BLE001 - an op torch cannot replay here is skipped, not fatal
        notes.append(f"note: op #{index} {node.name} not replayed on torch: {type(e).__name__}: {e}")
        return None
    for k, (a, b) in enumerate(zip(outs, expected, strict=False)):
        assert a is not None
        res = compare_tensors(f"{node.name}[{k}]", a, b, mode="allclose", rtol=rtol, atol=atol)
        if not res.ok:
            return OpMismatch(
                node.name,
                format_operator(node),
                index,
                res.max_abs_error,
                res.max_rel_error,
                res.neighbourhood,
            )
    return None


def _replay(node: Any, ins: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Torch's answer for ``node`` given the global values of its inputs."""
    if node.name == "redistribute":
        x = ins[0]
        assert x is not None
        return [x]  # a redistribute keeps the global value
    by_id = {}
    for x, v in zip(node.inputs, ins, strict=True):
        if x is not None and v is not None:
            by_id[x.id] = v.clone()

    def conv(a: Any) -> Any:
        if isinstance(a, Operand):
            return by_id[a.id]
        if isinstance(a, torch.device) and a.type not in ("cpu", "cuda"):
            return torch.device("cpu")
        return a

    args = tree_map(conv, node.args)
    kwargs = tree_map(conv, node.kwargs)
    if "device" in kwargs and not isinstance(kwargs["device"], torch.device):
        kwargs["device"] = "cpu"
    out = node.op(*args, **kwargs)
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _placement_str(t: torch.Tensor) -> str:
    from torch_dtorch.device.dispatch import operand_of
    from torch_dtorch.device.tensors import is_dtorch

    if not is_dtorch(t):
        return f"torch {str(t.dtype).removeprefix('torch.')}{list(t.shape)} on {t.device}"
    op = operand_of(t)
    where = op.mesh.describe(op.placements) if op.mesh is not None else "unbound"
    return f"{op.type_str()} {where}"


def _fetch_async(t: torch.Tensor) -> TensorFuture | torch.Tensor:
    from torch_dtorch.device.tensors import is_dtorch

    if not is_dtorch(t):
        return t.detach().to("cpu", copy=True)
    from torch_dtorch.api import to_torch_async

    return to_torch_async(t)


def _resolve(value: TensorFuture | torch.Tensor) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    out = value.get(timeout=_TIMEOUT_S)
    assert isinstance(out, torch.Tensor)
    return out.detach().cpu()
