"""The ``dtorch`` torch.compile backend: entry point, plain and dtorch inputs, placement guards, one message per
call, asynchrony, fallbacks and errors."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.backend.options import CompileOptionsError

from .models import MLP, HookCounter, distribute_module, tp_mlp_plan, with_hook


def _mesh(n: int) -> dt.DeviceMesh:
    return dt.init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))


def test_entry_points_registered() -> None:
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    try:
        distribution("torch-dtorch")
    except PackageNotFoundError:
        pytest.skip(
            "torch-dtorch is not pip-installed here (a PYTHONPATH checkout): no entry points to check"
        )

    names = {ep.name: ep.value for ep in entry_points(group="torch_dynamo_backends")}
    assert names["dtorch"] == "torch_dtorch.backend:dtorch_backend"
    assert names["dtorch_debug"] == "torch_dtorch.backend:dtorch_debug_backend"
    assert "dtorch" in torch._dynamo.list_backends()


def test_plain_inputs_bit_identical() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        out = torch.compile(model, backend="dtorch")(x)
    assert out.device.type == "cpu"
    assert torch.equal(out, ref)


def test_dtorch_one_device_bit_identical() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(1)
        distribute_module(model, mesh)
        out = torch.compile(model, backend="dtorch")(dt.distribute_tensor(x, mesh, [Replicate()]))
        assert out.placements == (Replicate(),)
        assert torch.equal(out.full_tensor(), ref)


def test_tp_mlp_matches_eager_and_torch() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        dx = dt.distribute_tensor(x, mesh, [Replicate()])
        eager = model(dx)
        out = torch.compile(model, backend="dtorch")(dx)
        assert out.placements == eager.placements
        torch.testing.assert_close(out.full_tensor(), ref)
        assert torch.equal(out.full_tensor(), eager.full_tensor())


def test_placement_change_recompiles_variant() -> None:
    """Dynamo does not guard on placements: the runtime wrapper compiles one variant per input layout."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    reports: list[object] = []
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh)
        compiled = torch.compile(model, backend="dtorch", options={"reports": reports})
        a = compiled(dt.distribute_tensor(x, mesh, [Shard(0)]))
        b = compiled(dt.distribute_tensor(x, mesh, [Replicate()]))
        c = compiled(dt.distribute_tensor(x, mesh, [Shard(0)]))  # cached
        assert a.placements == (Shard(0),) and b.placements == (Replicate(),)
        for y in (a, b, c):
            torch.testing.assert_close(y.full_tensor(), ref)
    assert len(reports) == 2


def _compiled_tp_mlp() -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TP MLP on 2 devices compiled and called once: (compiled model, its input, its first output, the torch
    reference)."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        dx = dt.distribute_tensor(x, mesh, [Replicate()])
        compiled = torch.compile(model, backend="dtorch")
        first = compiled(dx)  # compile + load
        first.full_tensor()
    return compiled, dx, first, ref


def test_one_message_per_call_and_async() -> None:
    compiled, dx, first, ref = _compiled_tp_mlp()
    with torch.no_grad():
        counter = HookCounter()
        with_hook(counter, lambda: [compiled(dx) for _ in range(3)])
        assert counter.counts == {"RunProgram": 3 * 2}  # one per call per worker, no per-op instruction
        # the call returns before the workers run: block them and look at the result's metadata
        from torch_dtorch.runtime import op_runner as kernel

        gate = threading.Event()

        def block(instr: object, device: int) -> None:
            gate.wait(30)

        kernel.before_hooks.append(block)
        try:
            y = compiled(dx)
            dt.to_torch_async(y)  # flushes: the workers now wait at the gate
            assert y.shape == (4, 8) and y.placements == first.placements
        finally:
            gate.set()
            kernel.before_hooks.remove(block)
        torch.testing.assert_close(y.full_tensor(), ref)


def test_compiled_call_starts_on_workers_at_once() -> None:
    """A compiled call is sent to the workers when it is made: no waiting for later ops, the flush timer or a
    value request (with a one-hour timer, the workers still see the ``RunProgram`` right away)."""
    compiled, dx, _, ref = _compiled_tp_mlp()
    with torch.no_grad():
        from torch_dtorch.device.state import get_session
        from torch_dtorch.runtime import op_runner as kernel

        executor = get_session().executor
        interval, executor.flush_interval = executor.flush_interval, 3600.0
        seen = threading.Event()

        def hook(instr: object, device: int) -> None:
            if type(instr).__name__ == "RunProgram":
                seen.set()

        kernel.before_hooks.append(hook)
        try:
            y = compiled(dx)
            assert seen.wait(10), "the RunProgram waited in the controller's batch"
            assert not executor._pending
        finally:
            kernel.before_hooks.remove(hook)
            executor.flush_interval = interval
        torch.testing.assert_close(y.full_tensor(), ref)


def test_graph_break_falls_back_to_eager() -> None:
    class Broken(MLP):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.silu(self.up(x))
            torch._dynamo.graph_break()
            return self.norm(x + self.down(h))

    torch.manual_seed(0)
    model, x = Broken(), torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        out = torch.compile(model, backend="dtorch")(dt.distribute_tensor(x, mesh, [Replicate()]))
        torch.testing.assert_close(out.full_tensor(), ref)


def test_scalar_cpu_input_is_uploaded() -> None:
    def f(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s + 1

    mesh = _mesh(2)
    x = torch.randn(4, 4)
    out = torch.compile(f, backend="dtorch")(dt.distribute_tensor(x, mesh, [Shard(0)]), torch.tensor(3.0))
    torch.testing.assert_close(out.full_tensor(), x * 3 + 1)


def test_grad_required_compiles_training() -> None:
    """An input that requires grad compiles a forward and a backward program (tests/backend/test_compiled_training.py
    covers it); a plain model on plain inputs trains like torch."""
    model = MLP()
    x = torch.randn(4, 8, requires_grad=True)
    torch.compile(model, backend="dtorch")(x).sum().backward()
    assert x.grad is not None and all(p.grad is not None for p in model.parameters())


def test_bad_options() -> None:
    f = torch.compile(lambda x: x + 1, backend="dtorch", options={"worker_compilr": "inductor"})
    with pytest.raises(Exception, match="unknown option"):
        f(torch.ones(2))
    torch._dynamo.reset()
    g = torch.compile(lambda x: x + 1, backend="dtorch", options={"cudagraphs": True})
    with pytest.raises(Exception, match="worker_compiler='inductor'"):
        g(torch.ones(2))
    with pytest.raises(CompileOptionsError):
        from torch_dtorch.backend.options import CompileOptions

        CompileOptions.parse({"redistribute": "sometimes"}, backend="dtorch")


def test_cudagraphs_need_one_rank_per_gpu() -> None:
    from torch_dtorch.backend.options import CompileOptions, check_cudagraph_devices

    on = CompileOptions.parse({"worker_compiler": "inductor", "cudagraphs": True}, backend="dtorch")
    off = CompileOptions.parse({"worker_compiler": "inductor"}, backend="dtorch")
    virtual = {0: torch.device("cuda", 0), 1: torch.device("cuda", 0)}
    with pytest.raises(
        NotImplementedError, match=r"ranks \[0, 1\].*one GPU \(cuda:0.*Fix: drop cudagraphs=True"
    ):
        check_cudagraph_devices(on, virtual, backend="dtorch")
    check_cudagraph_devices(off, virtual, backend="dtorch")  # no CUDA graphs: fine
    check_cudagraph_devices(on, {0: torch.device("cuda", 0), 1: torch.device("cuda", 1)}, backend="dtorch")
    check_cudagraph_devices(on, {0: torch.device("cpu"), 1: torch.device("cpu")}, backend="dtorch")  # ignored


def test_debug_backend_shows_graphs_without_running_programs() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    out_text = io.StringIO()
    reports: list[object] = []
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        dx = dt.distribute_tensor(x, mesh, [Replicate()])
        compiled = torch.compile(
            model, backend="dtorch_debug", options={"file": out_text, "reports": reports}
        )
        counter = HookCounter()
        y = with_hook(counter, lambda: compiled(dx))
        torch.testing.assert_close(y.full_tensor(), ref)
    assert "RunProgram" not in counter.counts and counter.counts  # ran eagerly, op by op
    text = out_text.getvalue()
    for section in (
        "captured aten graph",
        "LogicalGraph",
        "local program of device 0",
        "local program of device 1",
    ):
        assert section in text
    assert "reduce_scatter" in text
    assert len(reports) == 1


@pytest.mark.slow
def test_worker_compiler_inductor() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    with torch.no_grad():
        ref = model(x)
        twin = MLP()
        twin.load_state_dict(model.state_dict())
        plain = torch.compile(twin, backend="dtorch", options={"worker_compiler": "inductor"})
        torch.testing.assert_close(plain(x), ref)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        compiled = torch.compile(model, backend="dtorch", options={"worker_compiler": "inductor"})
        dx = dt.distribute_tensor(x, mesh, [Replicate()])
        torch.testing.assert_close(compiled(dx).full_tensor(), ref)
        torch.testing.assert_close(compiled(dx).full_tensor(), ref)


def test_program_error_is_sticky_and_named() -> None:
    """A poisoned input poisons every output of the call; the fetch raises a KernelError, other tensors work."""
    from torch_dtorch.runtime.blob import KernelError

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w).relu()

    mesh = _mesh(2)
    compiled = torch.compile(f, backend="dtorch")
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    w = dt.distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    torch.testing.assert_close(compiled(x, w).full_tensor(), (x.full_tensor() @ w.full_tensor()).relu())
    poisoned = dt.from_local([torch.randn(2, 4), torch.randn(2, 4)], mesh, [Shard(0)])
    from torch_dtorch.device.dispatch import operand_of
    from torch_dtorch.device.state import get_session

    get_session().executor.free(operand_of(poisoned))  # its blobs vanish: reading them is an error
    y = compiled(poisoned, w)
    with pytest.raises(KernelError, match="compiled program"):
        y.full_tensor()
    torch.testing.assert_close(compiled(x, w).full_tensor(), (x.full_tensor() @ w.full_tensor()).relu())


def test_load_program_codec_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process mode ships a LoadProgram as its propagated operators: decoded, each rank builds the same program."""
    from torch_dtorch.backend import compiled as runtime
    from torch_dtorch.backend.local import build_local_program
    from torch_dtorch.backend.program import LoadProgram, RunProgram
    from torch_dtorch.cluster.codec import BatchDecoder, BatchEncoder

    sent: list[object] = []
    real_submit = runtime._submit
    monkeypatch.setattr(runtime, "_submit", lambda ex, instr: (sent.append(instr), real_submit(ex, instr)))
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    with torch.no_grad():
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        torch.compile(model, backend="dtorch")(dt.distribute_tensor(x, mesh, [Shard(0)])).full_tensor()
    load = next(i for i in sent if isinstance(i, LoadProgram))
    run = RunProgram(load.program_id, (3, 1, 2), (7,), "site")
    decoded = BatchDecoder().decode(BatchEncoder().encode([load, run]))
    assert isinstance(decoded[0], LoadProgram) and decoded[0].programs == {} and decoded[0].source is not None
    assert decoded[1] == run
    # the six parameters are static inputs of the workers' inductor compiles (as plain torch.compile's are)
    assert len(load.static_inputs) == 6 and decoded[0].static_inputs == load.static_inputs
    for d in (0, 1):
        assert str(build_local_program(decoded[0].source, d)) == str(load.programs[d])


def _old_tracers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch 2.13's tracers behave like older ones (2.11): every functional composite op is decomposed."""
    import torch._subclasses.functional_tensor as functional
    import torch.fx.experimental.proxy_tensor as proxy

    always = lambda func, flat_args: True  # noqa: E731
    monkeypatch.setattr(functional, "autograd_would_have_decomposed", always)
    monkeypatch.setattr(proxy, "autograd_would_have_decomposed", always)


@pytest.mark.parametrize("fallback", [False, True])
def test_composites_stay_whole_on_older_torch(monkeypatch: pytest.MonkeyPatch, fallback: bool) -> None:
    """torch 2.11 tracers would split linear/layer_norm on dtorch tensors; the decompose fallback keeps them whole."""
    from torch_dtorch._compat import composites
    from torch_dtorch.backend.report import CompileReport

    _old_tracers(monkeypatch)
    monkeypatch.setattr(composites, "FORCE_COMPOSITE_FALLBACK", fallback)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 8)
    reports: list[CompileReport] = []
    with torch.no_grad():
        ref = model(x)
        mesh = _mesh(2)
        distribute_module(model, mesh, tp_mlp_plan())
        compiled = torch.compile(model, backend="dtorch", options={"reports": reports})
        out = compiled(dt.distribute_tensor(x, mesh, [Replicate()]))
        torch.testing.assert_close(out.full_tensor(), ref)
    aten = reports[0].aten
    if fallback:
        assert "aten.linear(" in aten and "aten.layer_norm(" in aten and "aten.addmm" not in aten
    else:  # the simulation does reach the tracers: without the fallback the composites are split
        assert "aten.linear(" not in aten
    assert type(torch.ops.aten.linear.default).decompose is composites._ORIGINAL_DECOMPOSE  # restored


@pytest.mark.parametrize("n", [1, 2])
def test_worker_inductor_traces_a_one_operand_einsum(n: int) -> None:
    """SD3's unpatchify (``einsum("nhwpqc->nchpwq", x)``, a permutation: torch returns a view of the operand) in a
    segment the workers compile with inductor: the einsum kernel's aliasing check ran on the traced (functional)
    tensors, whose storage has no data pointer, and the compile failed ("invalid python storage", found on an H100)."""

    def unpatchify(x: torch.Tensor) -> torch.Tensor:
        y = x.view(2, 4, 4, 2, 2, 3)
        return torch.einsum("nhwpqc->nchpwq", y).reshape(2, 3, 8, 8) * 2

    x = torch.randn(2, 16, 12)
    mesh = _mesh(n)
    compiled = torch.compile(unpatchify, backend="dtorch", options={"worker_compiler": "inductor"})
    out = compiled(dt.distribute_tensor(x, mesh, [Shard(0)]))
    torch.testing.assert_close(out.full_tensor(), unpatchify(x))
