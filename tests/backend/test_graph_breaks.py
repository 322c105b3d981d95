"""Graph breaks under ``torch.compile(backend="dtorch")``: the frames around a break compile, the break runs eagerly
on dtorch tensors, results equal eager torch — and dynamo never traces dtorch's own code (dispatch kernels, executor)
when it meets it as a new frame (``_compat.hide_from_dynamo``)."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard, _compat
from torch_dtorch.backend import dtorch_backend

from .models import distribute_module

log = logging.getLogger(__name__)

BREAKS = ("graph_break", "print", "item", "none")


def _break(kind: str, x: torch.Tensor) -> torch.Tensor:
    """One graph break of the given kind (``none``: no break)."""
    if kind == "graph_break":
        torch._dynamo.graph_break()
    elif kind == "print":
        print("layer done")  # noqa: T201 - a print is the classic user graph break
    elif kind == "item" and x.abs().sum().item() > 1e9:  # data-dependent control flow: never true
        x = x * 0
    return x


class Block(nn.Module):
    """A decoder-layer-like block; ``inner`` puts the break inside its forward (a break with no loop around it)."""

    def __init__(self, dim: int, *, inner: str = "none") -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.up(x))
        h = _break(self.inner, h)
        return x + self.down(h)


class Looped(nn.Module):
    """Layers in a loop with a break inside the loop (``outer``) and/or inside each layer (``inner``)."""

    def __init__(
        self, dim: int = 8, num_layers: int = 3, *, outer: str = "none", inner: str = "none"
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(dim, inner=inner) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(dim)
        self.outer = outer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 2
        for layer in self.layers:
            x = layer(x)
            x = _break(self.outer, x)
        return self.norm(x)


def _tp_plan(num_layers: int) -> dict[str, Sequence[Any]]:
    plan: dict[str, Sequence[Any]] = {}
    for i in range(num_layers):
        plan |= {f"layers.{i}.up.weight": [Shard(0)], f"layers.{i}.up.bias": [Shard(0)]}
        plan |= {f"layers.{i}.down.weight": [Shard(1)]}
    return plan


def _recording_backend(graphs: list[fx.GraphModule]) -> Callable[..., Any]:
    def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(gm)
        return dtorch_backend(gm, example_inputs)

    return backend


def _traced_files(graphs: Sequence[fx.GraphModule]) -> set[str]:
    """The source files of every op dynamo put in a graph (from the nodes' stack traces)."""
    files = set()
    for gm in graphs:
        for node in gm.graph.nodes:
            trace = node.meta.get("stack_trace") or ""
            files |= {line.split('"')[1] for line in trace.splitlines() if line.strip().startswith('File "')}
    return files


def _run(
    model: nn.Module,
    mesh: dt.DeviceMesh,
    x: torch.Tensor,
    placements: Sequence[Any],
    plan: dict[str, Sequence[Any]] | None = None,
    *,
    calls: int = 2,
) -> tuple[torch.Tensor, list[fx.GraphModule]]:
    """Eager torch reference vs the compiled model on dtorch tensors; returns the reference and dynamo's graphs."""
    with torch.no_grad():
        ref = model(x)
        distribute_module(model, mesh, plan)
        graphs: list[fx.GraphModule] = []
        compiled = torch.compile(model, backend=_recording_backend(graphs))
        for _ in range(calls):  # the second call runs the cached graphs around the break
            y = compiled(dt.distribute_tensor(x, mesh, list(placements)))
            torch.testing.assert_close(y.full_tensor(), ref)
    return ref, graphs


def _assert_only_model_code(graphs: Sequence[fx.GraphModule]) -> None:
    internal = {f for f in _traced_files(graphs) if "/torch_dtorch/" in f}
    assert not internal, f"dynamo traced dtorch's own code into a graph: {sorted(internal)}"


@pytest.fixture
def mesh2() -> dt.DeviceMesh:
    return dt.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))


@pytest.mark.parametrize("kind", BREAKS)
@pytest.mark.parametrize("where", ["outer", "inner"])
def test_break_in_a_loop_equals_eager(mesh2: dt.DeviceMesh, where: str, kind: str) -> None:
    torch.manual_seed(0)
    model = Looped(**{where: kind})
    _, graphs = _run(model, mesh2, torch.randn(5, 8), [Shard(0)])  # 5 rows: uneven shards
    _assert_only_model_code(graphs)
    assert graphs, "the blocks around the break compile"
    # a break inside each block splits its forward in two graphs (before / after), compiled once for all layers
    if where == "inner" and kind != "none":
        assert len(graphs) >= 2


@pytest.mark.parametrize("kind", ["graph_break", "item"])
def test_break_with_tensor_parallel_layers(mesh2: dt.DeviceMesh, kind: str) -> None:
    torch.manual_seed(1)
    model = Looped(outer=kind, inner=kind)
    _, graphs = _run(model, mesh2, torch.randn(4, 8), [Replicate()], _tp_plan(3))
    _assert_only_model_code(graphs)


def test_break_on_a_2d_mesh() -> None:
    mesh = dt.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(2)
    model = Looped(outer="graph_break", inner="item")
    _, graphs = _run(model, mesh, torch.randn(6, 8), [Shard(0), Replicate()])
    _assert_only_model_code(graphs)


def test_print_break_prints(mesh2: dt.DeviceMesh, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(3)
    _run(Looped(outer="print"), mesh2, torch.randn(4, 8), [Shard(0)], calls=1)
    assert capsys.readouterr().out.count("layer done") == 2 * 3  # eager reference + compiled, 3 layers each


def test_fullgraph_refuses_a_break(mesh2: dt.DeviceMesh) -> None:
    torch.manual_seed(4)
    model = Looped(inner="graph_break")
    with torch.no_grad():
        distribute_module(model, mesh2)
        compiled = torch.compile(model, backend="dtorch", fullgraph=True)
        with pytest.raises(Exception, match="graph_break|graph break") as info:
            compiled(dt.distribute_tensor(torch.randn(4, 8), mesh2, [Shard(0)]))
    log.debug("fullgraph=True with a break: %s", info.value)


def test_plain_inputs_with_symbolic_sizes() -> None:
    """dynamic=True on plain tensors gives graphs with SymInt inputs: they run as captured (they used to fail in
    the compile report's propagation)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * x.shape[0]

    compiled = torch.compile(fn, backend="dtorch", dynamic=True)
    for n in (4, 5):
        x = torch.randn(n)
        assert torch.equal(compiled(x), fn(x))


def _sizes_fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    z = torch.sin(x) * x.shape[0] + y.sum()
    return z.view(-1, 3).T.contiguous(), z.shape[0] + 1  # a symbolic view, a transposed output, a size output


@pytest.mark.parametrize("devices", [1, 2])
def test_symbolic_sizes_on_whole_operands_run_one_shipped_program(
    devices: int, compiled_graphs: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A graph with symbolic sizes (``dynamic=True``; HF ``generate``'s decode steps with a growing KV cache, which
    dynamo marks dynamic by itself) whose operands are whole on every rank (a 1-device mesh, replicated inputs)
    ships one program: every size replays it, with the sizes passed per call. Results (and the size output) equal
    torch; no call runs the ops eagerly."""
    mesh = dt.init_device_mesh("cpu", (devices,))
    reports: list[Any] = []
    compiled = torch.compile(_sizes_fn, backend="dtorch", dynamic=True, options={"reports": reports})
    with caplog.at_level(logging.WARNING, logger="torch_dtorch.backend.compiled"):
        for n in (4, 5, 6, 7, 9):
            x, y = torch.randn(n, 3), torch.randn(2)
            got, k = compiled(
                dt.distribute_tensor(x, mesh, [Replicate()]), dt.distribute_tensor(y, mesh, [Replicate()])
            )
            want, want_k = _sizes_fn(x, y)
            torch.testing.assert_close(got.full_tensor(), want)
            assert got.shape == want.shape and got.stride() == want.stride() and k == want_k
    assert not [r for r in caplog.records if "eagerly" in r.getMessage()]
    symbolic = [g for g in compiled_graphs if g.symbolic]
    assert symbolic, "dynamo compiled no graph with symbolic sizes"
    assert all(g.eager_calls == 0 and g.num_variants == 1 for g in symbolic)
    assert [r.error for r in reports if "symbolic" in str(r.local)] == [None] * len(symbolic)


def test_symbolic_sizes_compile_once_with_the_workers_inductor(
    compiled_graphs: list[Any], symbolic_compiles: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """``worker_compiler="inductor"``: each worker compiles the graph program of a graph with symbolic sizes once,
    for every size (its inputs' dims are the graph's size symbols), not per size and not left uncompiled; a
    non-contiguous input (a transposed view) is made contiguous for it. Results equal torch at every size."""
    mesh = dt.init_device_mesh("cpu", (2,))
    options = {"worker_compiler": "inductor"}
    compiled = torch.compile(_sizes_fn, backend="dtorch", dynamic=True, options=options)
    with caplog.at_level(logging.INFO, logger="torch_dtorch.backend.program"):
        for n in (4, 5, 6, 7, 9):
            x, y = torch.randn(3, n), torch.randn(2)
            xd = dt.distribute_tensor(x, mesh, [Replicate()]).t()  # [n, 3], a view: strided on the workers
            got, k = compiled(xd, dt.distribute_tensor(y, mesh, [Replicate()]))
            want, want_k = _sizes_fn(x.t(), y)
            torch.testing.assert_close(got.full_tensor(), want)
            assert k == want_k
    dt.sync()
    assert not [r for r in caplog.records if "uncompiled" in r.getMessage()]
    assert len(symbolic_compiles) == 2  # one program, compiled once by each of the 2 workers
    assert all(
        any(isinstance(d, str) for spec in c if not isinstance(spec, str) for d in spec[0])
        for c in symbolic_compiles
    )
    symbolic = [g for g in compiled_graphs if g.symbolic]
    assert symbolic and all(g.eager_calls == 0 and g.num_variants == 1 for g in symbolic)


def test_symbolic_sizes_outside_a_compiled_variants_guard_compile_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inductor's conditions on the sizes (its guard: here, made to hold for sizes up to 6 only) are checked at
    every call; a size outside every compiled variant's guard compiles another variant (one per worker), and
    results stay equal to torch."""
    from torch_dtorch import _compat

    compiles: list[int] = []
    real = _compat.inductor_compile_symbolic

    def rows(xs: Any) -> int:
        return int(next(a.shape[0] for a in xs if isinstance(a, torch.Tensor) and a.dim() == 2))

    def bounded(gm: Any, inputs: Any, args: Any, **kwargs: Any) -> Any:
        fn, _ = real(gm, inputs, args, **kwargs)
        compiles.append(rows(args))
        limit = 6 if rows(args) <= 6 else 10**9
        return fn, (lambda xs: rows(xs) <= limit)

    monkeypatch.setattr(_compat, "inductor_compile_symbolic", bounded)
    mesh = dt.init_device_mesh("cpu", (2,))
    compiled = torch.compile(
        _sizes_fn, backend="dtorch", dynamic=True, options={"worker_compiler": "inductor"}
    )
    for n in (4, 5, 6, 7, 9, 5):
        x, y = torch.randn(n, 3), torch.randn(2)
        got, _ = compiled(
            dt.distribute_tensor(x, mesh, [Replicate()]), dt.distribute_tensor(y, mesh, [Replicate()])
        )
        torch.testing.assert_close(got.full_tensor(), _sizes_fn(x, y)[0])
    dt.sync()  # (a replicated result is fetched from one rank: the other's program may still run)
    assert sorted(compiles) == [4, 4, 7, 7]  # per worker: the first size, then the first size past the guard


def test_symbolic_sizes_on_a_sharded_operand_run_eagerly_and_say_so(
    compiled_graphs: list[Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Sharded over a symbolic dim, the placements could depend on the sizes: no shipped program; the ops run one
    by one on dtorch tensors, equal torch, and the fallback is logged once with its reason and the fix."""
    mesh = dt.init_device_mesh("cpu", (2,))

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * x.shape[0]

    compiled = torch.compile(fn, backend="dtorch", dynamic=True)
    with caplog.at_level(logging.WARNING, logger="torch_dtorch.backend.compiled"):
        for n in (4, 5, 6, 7):
            x = torch.randn(n, 3)
            got = compiled(dt.distribute_tensor(x, mesh, [Shard(0)]))
            torch.testing.assert_close(got.full_tensor(), fn(x))
    said = [r.getMessage() for r in caplog.records if "runs its ops eagerly" in r.getMessage()]
    assert len(said) == 1, said
    assert "symbolic (dynamic) shapes" in said[0] and "S(0)" in said[0] and "pass dynamic=False" in said[0]
    assert sum(g.eager_calls for g in compiled_graphs if g.symbolic) >= 2


def test_hide_from_dynamo_skips_frames_and_their_callees() -> None:
    """A hidden module's functions, and what they call, run untraced where dynamo's frame hook meets them."""
    mod = types.ModuleType("dtorch_hidden_probe")
    src = (
        "import torch\n"
        "def helper(x):\n    return torch.cos(x) + 1\n"
        "def entry(x):\n    return helper(x) * 2\n"
        "TABLE = [lambda x: torch.tan(x)]\n"
    )
    exec(compile(src, "<dtorch_hidden_probe>", "exec"), mod.__dict__)  # noqa: S102 - a throwaway probe module
    sys.modules[mod.__name__] = mod
    try:
        graphs: list[fx.GraphModule] = []

        def backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            graphs.append(gm)
            return gm.forward

        def user(x: torch.Tensor) -> torch.Tensor:
            for _ in range(2):
                x = x + 1
                torch._dynamo.graph_break()  # a break in a loop: this frame runs eagerly, callees are new frames
                x = mod.entry(x) + mod.TABLE[0](x)
            return x

        x = torch.randn(3)
        expected = user(x)
        torch.testing.assert_close(torch.compile(user, backend=backend)(x), expected)
        assert graphs, "not hidden: dynamo compiles entry() and the lambda as frames of their own"
        torch._dynamo.reset()
        graphs.clear()
        assert _compat.hide_from_dynamo([mod]) >= 3  # entry, helper, the lambda
        torch.testing.assert_close(torch.compile(user, backend=backend)(x), expected)
        assert not graphs, "hidden functions (and their callees) must not be compiled as frames"
    finally:
        del sys.modules[mod.__name__]


@pytest.fixture(scope="module")
def process_mesh() -> Iterator[dt.DeviceMesh]:
    mp = pytest.MonkeyPatch()
    mp.setenv("DTORCH_HEARTBEAT_TIMEOUT_S", "10")  # a loaded 2-core CI machine, as in test_process.py
    mp.setenv("DTORCH_CONTROLLER_TIMEOUT_S", "30")
    dt.shutdown()
    try:
        yield dt.init_device_mesh("cpu", (2,), mode="process")
    finally:
        dt.shutdown()
        mp.undo()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["graph_break", "item"])
def test_break_on_processes(process_mesh: dt.DeviceMesh, kind: str) -> None:
    torch.manual_seed(5)
    model = Looped(outer=kind, inner=kind)
    _, graphs = _run(model, process_mesh, torch.randn(5, 8), [Shard(0)], _tp_plan(3))
    _assert_only_model_code(graphs)
