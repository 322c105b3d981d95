"""OpInfo conformance: run PyTorch's own OpInfo samples through dtorch on real workers and classify the outcome.

For every OpInfo with float32 samples (capped per op), each sample runs

- on a 1-device mesh with every tensor Replicate: the result must be **bit-identical** to torch;
- on a 3-device and a 2x2 mesh, once all-Replicate and once per valid tensor dim ``d`` with the sample's input (and
  every other tensor argument of the same shape) ``Shard(d)`` on every mesh axis (nested on 2x2; uneven and
  size-1 dims included): the result must be ``allclose`` to torch.

A case that passes is **sharded** when no input shard was gathered on the way (no ``S -> R`` redistribute of any
input), otherwise a **fallback** pass (dtorch redistributed to Replicate and computed there). Failures are
**no rule** (``NoRuleError``), **wrong** (a value, shape or dtype differing from torch) or **error** (any other
exception). One status per (op, mesh) summarizes its cases, worst first: wrong > error > no rule > fallback >
sharded.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

import torch_dtorch as dt
from tests.opinfo_samples import quick_sample_inputs
from torch_dtorch.device.tensors import is_dtorch
from torch_dtorch.errors import NoRuleError
from torch_dtorch.executor.constructor import REDISTRIBUTE
from torch_dtorch.graph import Operator
from torch_dtorch.placement import Placement, Replicate, Shard

__all__ = [
    "MESHES",
    "CaseResult",
    "OpResult",
    "Status",
    "conformance_opinfos",
    "op_key",
    "run_opinfo",
]

#: mesh shapes, largest first (the worker pool is started once for 4 devices and reused by the smaller meshes)
MESHES: tuple[tuple[int, ...], ...] = ((2, 2), (3,), (1,))
ATOL = 1e-4
RTOL = 1e-4


class Status(enum.Enum):
    """Outcome of one case, and (worst case first) of one op on one mesh."""

    WRONG = "wrong"
    ERROR = "error"
    NO_RULE = "no rule"
    FALLBACK = "fallback"
    SHARDED = "sharded"

    @property
    def passed(self) -> bool:
        return self in (Status.SHARDED, Status.FALLBACK)


_ORDER = list(Status)


@dataclass
class CaseResult:
    sample: int
    placements: str
    status: Status
    detail: str = ""


@dataclass
class OpResult:
    """Every case of one OpInfo on one mesh, and its summary status."""

    op: str
    mesh: tuple[int, ...]
    cases: list[CaseResult] = field(default_factory=list)
    #: samples torch itself could not run (why), so no dtorch case was built from them
    skipped: list[str] = field(default_factory=list)

    @property
    def status(self) -> Status:
        if not self.cases:
            return Status.ERROR
        worst = min((c.status for c in self.cases), key=_ORDER.index)
        if worst is Status.SHARDED and not any(c.placements != "R" for c in self.cases):
            return Status.FALLBACK  # nothing could be sharded (only 0-d inputs): a Replicate-only pass
        return worst

    def first_failure(self) -> CaseResult | None:
        if not self.cases:
            return CaseResult(
                -1, "-", Status.ERROR, "no case ran: " + ("; ".join(self.skipped) or "no samples")
            )
        bad = [c for c in self.cases if not c.status.passed]
        return min(bad, key=lambda c: _ORDER.index(c.status)) if bad else None


def op_key(info: Any) -> str:
    return f"{info.name}.{info.variant_test_name}" if info.variant_test_name else info.name


def conformance_opinfos() -> list[Any]:
    """Every OpInfo of ``op_db`` that has float32 samples on the CPU, sorted by key."""
    from torch.testing._internal.common_methods_invocations import op_db

    return sorted((o for o in op_db if torch.float32 in o.supported_dtypes("cpu")), key=op_key)


def samples_for(info: Any, cap: int) -> list[Any]:
    """The first ``cap`` float32 samples (drawn deterministically)."""
    torch.manual_seed(0)
    out = []
    with contextlib.suppress(Exception), quick_sample_inputs():
        for s in info.sample_inputs("cpu", torch.float32, requires_grad=False):
            out.append(s)
            if len(out) >= cap:
                break
    return out


# --- placements ---------------------------------------------------------------------------------------------------


def _tensors(sample: Any) -> list[torch.Tensor]:
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def placement_configs(sample: Any, mesh_shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """``("R", None)`` and, on a mesh of more than one device, ``("S(d)", d)`` for every dim of the sample input."""
    configs: list[tuple[str, int | None]] = [("R", None)]
    if math.prod(mesh_shape) == 1:
        return configs
    primary = _primary(sample)
    if primary is not None:
        configs += [(f"S({d})", d) for d in range(primary.ndim)]
    return configs


def _primary(sample: Any) -> torch.Tensor | None:
    if isinstance(sample.input, torch.Tensor):
        return sample.input
    if isinstance(sample.input, (list, tuple)) and sample.input and isinstance(sample.input[0], torch.Tensor):
        return sample.input[0]
    return None


def _placements_for(
    t: torch.Tensor, shard_dim: int | None, primary: torch.Tensor | None, mesh: Any
) -> list[Any]:
    rep: list[Placement] = [Replicate()] * mesh.ndim
    if shard_dim is None or primary is None or t.ndim == 0:
        return rep
    if (
        t is primary
        or (t.shape == primary.shape)
        or (t.ndim == primary.ndim and t.shape[shard_dim] == primary.shape[shard_dim])
    ) and shard_dim < t.ndim:
        return [Shard(shard_dim)] * mesh.ndim
    return rep


# --- running one case ----------------------------------------------------------------------------------------------


class _Recorder:
    """Watches the operators added while a case runs: was any input shard gathered (an ``S -> R`` move)?"""

    def __init__(self) -> None:
        self.gathered = False
        self.lock = threading.Lock()

    def __call__(self, node: Operator) -> None:
        if node.op != REDISTRIBUTE or not node.inputs or not node.outputs:
            return
        src, dst = node.inputs[0], node.outputs[0]
        if src is None or dst is None or src.mesh is None or dst.mesh is None:
            return
        for a, b in zip(src.root_placements, dst.root_placements):
            if isinstance(a, Shard) and not isinstance(b, Shard):
                self.gathered = True


@contextlib.contextmanager
def _record() -> Iterator[_Recorder]:
    from torch_dtorch.device.state import get_session

    listeners = get_session().executor.constructor.listeners
    rec = _Recorder()
    listeners.append(rec)
    try:
        yield rec
    finally:
        listeners.remove(rec)


def _to_dtorch(sample: Any, mesh: Any, shard_dim: int | None) -> tuple[Any, Any, Any]:
    primary = _primary(sample)

    def conv(t: torch.Tensor) -> torch.Tensor:
        return dt.distribute_tensor(t.detach(), mesh, _placements_for(t, shard_dim, primary, mesh))

    return pytree.tree_map_only(torch.Tensor, conv, (sample.input, sample.args, sample.kwargs))


def _fetch(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: dt.to_torch(t) if is_dtorch(t) else t, value)


def _compare(got: Any, want: Any, exact: bool) -> str:
    """'' when equal (bit-identical when ``exact``), else a description of the first difference."""
    if isinstance(want, torch.Size):
        want = tuple(want)
    if isinstance(got, torch.Size):
        got = tuple(got)
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    if g_spec != w_spec:
        return f"output structure {g_spec} != torch's {w_spec}"
    for i, (g, w) in enumerate(zip(g_leaves, w_leaves)):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"output {i}: {type(g).__name__} instead of a tensor"
            if g.shape != w.shape or g.dtype != w.dtype:
                return f"output {i}: {g.dtype}{list(g.shape)} != torch's {w.dtype}{list(w.shape)}"
            try:
                torch.testing.assert_close(
                    g,
                    w,
                    atol=0 if exact else ATOL,
                    rtol=0 if exact else RTOL,
                    equal_nan=True,
                    check_device=False,
                )
            except AssertionError as e:
                return f"output {i}: {str(e).splitlines()[0]} {' '.join(str(e).split()[-12:])}"
        elif isinstance(w, float) and isinstance(g, float):
            if not (
                g == w
                or (math.isnan(g) and math.isnan(w))
                or (not exact and math.isclose(g, w, rel_tol=RTOL, abs_tol=ATOL))
            ):
                return f"output {i}: {g} != {w}"
        elif g != w:
            return f"output {i}: {g!r} != torch's {w!r}"
    return ""


def _reference(fn: Callable[..., Any], sample: Any) -> Any:
    args = pytree.tree_map_only(torch.Tensor, torch.clone, (sample.input, sample.args, sample.kwargs))
    torch.manual_seed(0)
    return fn(args[0], *args[1], **args[2])


#: OpInfos whose values are uninitialized memory (``torch.empty*``): only shapes and dtypes are compared
UNINITIALIZED = frozenset(
    {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
)


def run_case(
    fn: Callable[..., Any], sample: Any, mesh: Any, shard_dim: int | None, want: Any, *, values: bool = True
) -> tuple[Status, str]:
    from torch_dtorch.device.registration import sync_stats

    exact = mesh.size() == 1
    syncs = sync_stats["calls"]
    with _record() as rec, mesh:
        try:
            inp, args, kwargs = _to_dtorch(sample, mesh, shard_dim)
            torch.manual_seed(0)
            got = _fetch(fn(inp, *args, **kwargs))
        except NoRuleError as e:
            return Status.NO_RULE, str(e).splitlines()[0]
        except Exception as e:  # noqa: BLE001 - every failure is classified and reported
            text = str(e).strip().splitlines()
            return Status.ERROR, f"{type(e).__name__}: {text[0] if text else ''}"[:300]
    if not values:
        got, want = _shapes(got), _shapes(want)
    diff = _compare(got, want, exact)
    if diff:
        return Status.WRONG, diff[:300]
    gathered = rec.gathered or sync_stats["calls"] != syncs
    return (Status.FALLBACK if gathered else Status.SHARDED), ""


def _shapes(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(t.shape, dtype=t.dtype).fill_(0), value)


def run_opinfo(info: Any, meshes: dict[tuple[int, ...], Any], cap: int) -> list[OpResult]:
    """Every capped sample of ``info`` on every mesh under every placement config."""
    results = {shape: OpResult(op_key(info), shape) for shape in meshes}
    for si, sample in enumerate(samples_for(info, cap)):
        try:
            want = _reference(info.op, sample)
        except Exception as e:  # noqa: BLE001 - torch itself rejects the sample: skip it, but say why
            for r in results.values():
                r.skipped.append(f"sample {si}: torch raised {type(e).__name__}: {str(e)[:120]}")
            continue
        for shape, mesh in meshes.items():
            for name, shard_dim in placement_configs(sample, shape):
                values = info.name not in UNINITIALIZED
                status, detail = run_case(info.op, sample, mesh, shard_dim, want, values=values)
                results[shape].cases.append(CaseResult(si, name, status, detail))
    return list(results.values())


def init_meshes(shapes: Sequence[tuple[int, ...]] = MESHES) -> dict[tuple[int, ...], Any]:
    return {shape: dt.init_device_mesh("cpu", shape) for shape in shapes}
