"""Workers replay fast-path hits through the local call resolved on the first hit (runtime/replay.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import torch_dtorch as dt
from tests.cluster.stream_stress import run_interleaved_program
from torch_dtorch import Replicate, Shard
from torch_dtorch.config import get_config
from torch_dtorch.device.state import get_session
from torch_dtorch.graph import Operand
from torch_dtorch.placement_rules import LocalContext, OpCall, get_rule
from torch_dtorch.runtime.blob import KernelError
from torch_dtorch.runtime.native_replay import extension as native_extension
from torch_dtorch.runtime.replay import AMBIGUOUS, LocalCall, resolve

aten = torch.ops.aten


def _operand(i: int) -> Operand:
    return Operand(i, (4, 4), torch.float32, None, None, None, None, [], None, None, False, None, None)


def _resolve(
    op: object, args: tuple[object, ...], kwargs: dict[str, object], inputs: list[Operand]
) -> object:
    call = OpCall(op, args, kwargs, list(inputs), None, [None] * len(inputs))
    ctx = LocalContext(
        device=0, coordinate=(), in_shapes=[x.shape for x in inputs], out_shapes=[], out_offsets=[]
    )
    return resolve(get_rule(op), call, ctx)


def test_resolve_a_pointwise_op() -> None:
    a, b = _operand(1), _operand(2)
    call = _resolve(aten.add.Tensor, (a, b), {"alpha": 2}, [a, b])
    assert isinstance(call, LocalCall)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(call.run([x, y])[0], x + 2 * y)
    # the same plan on swapped operands: positions come from the slots, not from the first call's tensors
    torch.testing.assert_close(call.run([y, x])[0], y + 2 * x)


def test_one_operand_in_two_slots_resolves_like_two_operands() -> None:
    """``x + x`` resolves (issue 20): the call ``x + y`` of the same plan would make, with a slot per argument."""
    a = _operand(1)
    call = _resolve(aten.add.Tensor, (a, a), {"alpha": 3}, [a, a])
    assert isinstance(call, LocalCall)
    assert call.tensor_slots == ((0, 0), (1, 1))
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(call.run([x, x])[0], x + 3 * x)
    torch.testing.assert_close(call.run([x, y])[0], x + 3 * y)  # the plan's other calls, distinct operands


def test_one_operand_in_a_list_and_a_slot() -> None:
    """``cat([a, b, a])``: the repeated element keeps its own list position."""
    a, b = _operand(1), _operand(2)
    call = _resolve(aten.cat.default, ([a, b, a], 1), {}, [a, b, a])
    assert isinstance(call, LocalCall)
    assert call.list_slots == ((0, (0, 1, 2)),)
    x, y, z = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(call.run([x, y, z])[0], torch.cat([x, y, z], 1))


def test_a_repeated_operand_in_a_keyword_is_ambiguous() -> None:
    a = _operand(1)
    assert _resolve(aten.add.Tensor, (a,), {"other": a}, [a, a]) is AMBIGUOUS


def test_rules_with_their_own_local_kernel_are_not_resolved() -> None:
    a = _operand(1)
    rule = get_rule(aten.dropout.default)  # draws the global mask and keeps the rank's slice
    assert not rule.kernel_is_op(aten.dropout.default)
    assert _resolve(aten.dropout.default, (a, 0.5, True), {}, [a]) is None
    assert not get_rule(aten.to.device).kernel_is_op(aten.to.device)  # names the rank's device


def test_a_reshape_resolves_with_its_localized_sizes() -> None:
    """``reshape`` localizes its sizes for the rank once; the replay uses them."""
    x = Operand(1, (8, 4), torch.float32, None, None, None, None, [], None, None, False, None, None)
    call = OpCall(aten.reshape.default, (x, [32]), {}, [x], None, [None])
    call.out_meta = get_rule(aten.reshape.default).infer_meta(call)
    ctx = LocalContext(device=0, coordinate=(), in_shapes=[(8, 4)], out_shapes=[(32,)], out_offsets=[(0,)])
    local = resolve(get_rule(aten.reshape.default), call, ctx)
    assert isinstance(local, LocalCall)
    t = torch.randn(8, 4)
    torch.testing.assert_close(local.run([t])[0], t.view(32))


@pytest.fixture
def mesh() -> Iterator[dt.DeviceMesh]:
    dt.shutdown()
    yield dt.init_device_mesh("cpu", (2,))
    dt.shutdown()


def _replayed() -> int:
    return sum(w.replayed for w in get_session().executor.runner.workers.values())


def test_hits_are_replayed_and_equal_torch(mesh: dt.DeviceMesh) -> None:
    xs = [torch.randn(6, 5) for _ in range(3)]
    a, b, c = (dt.distribute_tensor(x, mesh, [Shard(0)]) for x in xs)
    out = a + a  # one operand in both slots first: that call alone is not resolved
    for _ in range(4):
        out = out + b  # same plan as ``a + a``, other operands
        out = torch.mul(out, c) * 0.5
    dt.sync()
    assert _replayed() > 0
    ref = xs[0] + xs[0]
    for _ in range(4):
        ref = torch.mul(ref + xs[1], xs[2]) * 0.5
    torch.testing.assert_close(out.full_tensor(), ref)


def test_a_failing_replay_poisons_its_outputs_only(
    mesh: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = dt.distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
    for _ in range(3):
        ok = a * 3.0
    dt.sync()
    before = _replayed()
    run = LocalCall.run

    def failing(self: LocalCall, local: list[torch.Tensor | None]) -> list[torch.Tensor]:
        if self.op is aten.mul.Tensor:
            raise RuntimeError("injected failure")
        return run(self, local)

    monkeypatch.setattr(LocalCall, "run", failing)
    for w in get_session().executor.runner.workers.values():
        monkeypatch.setattr(w, "_chain", None)  # the Python replay (the native loop's errors: test below)
    bad = a * 3.0
    fine = a + 1.0
    with pytest.raises(KernelError, match=r"(?s)aten\.mul.*injected failure"):
        bad.full_tensor()
    assert _replayed() > before
    monkeypatch.undo()
    torch.testing.assert_close(fine.full_tensor(), a.full_tensor() + 1.0)
    torch.testing.assert_close(ok.full_tensor(), a.full_tensor() * 3.0)


def test_the_interleaved_program_with_and_without_replay(mesh: dt.DeviceMesh) -> None:
    run_interleaved_program(mesh, seed=5, steps=300, rows=8, cols=6)
    assert _replayed() > 50
    get_config().worker_replay = False
    try:
        dt.shutdown()
        off = dt.init_device_mesh("cpu", (2,))
        run_interleaved_program(off, seed=5, steps=300, rows=8, cols=6)
        assert _replayed() == 0
    finally:
        get_config().worker_replay = True


@pytest.mark.slow
def test_the_interleaved_program_on_worker_processes() -> None:
    """Process mode replays the decoded templates (the codec's interned template is the replay key)."""
    dt.shutdown()
    try:
        mesh = dt.init_device_mesh("cpu", (2,), mode="process")
        run_interleaved_program(mesh, seed=7, steps=300, rows=8, cols=6)
    finally:
        dt.shutdown()


def test_decoded_templates_carry_a_replay_key() -> None:
    from torch_dtorch.cluster.codec import BatchDecoder, BatchEncoder
    from torch_dtorch.cluster.transport import wire
    from torch_dtorch.executor.instructions import FastRun, RunOp

    dt.shutdown()
    try:
        mesh = dt.init_device_mesh("cpu", (2,))
        a = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        batches: list[list[object]] = []
        ex = get_session().executor
        submit = ex.runner.submit

        def spy(batch: list[object]) -> None:
            batches.append(list(batch))
            submit(batch)

        ex.runner.submit = spy
        for _ in range(3):
            a = a * 2.0
        dt.sync()
        ex.runner.submit = submit
    finally:
        dt.shutdown()
    runs = [i for b in batches for i in b if isinstance(i, FastRun)]
    assert len(runs) >= 2
    enc, dec = BatchEncoder(), BatchDecoder()
    decoded = []
    for seq, r in enumerate(runs, 1):
        frames = wire.encode(
            enc.encode([r]), kind=wire.MessageKind.BATCH, seq=seq, sender="c", secret=b"k" * 32
        )
        decoded += [i for i in dec.decode(wire.decode(frames, secret=b"k" * 32).body) if isinstance(i, RunOp)]
    keys = {id(i.replay_key) for i in decoded}
    assert None not in {i.replay_key for i in decoded} and len(keys) == 1


def _chains_ran() -> int:
    return sum(w._chain.ran for w in get_session().executor.runner.workers.values() if w._chain is not None)


@pytest.mark.skipif(native_extension() is None, reason="the native worker loop is not built here")
def test_the_native_loop_runs_chains_and_keeps_errors_sticky(mesh: dt.DeviceMesh) -> None:
    i = dt.distribute_tensor(torch.arange(1, 17).view(4, 4), mesh, [Shard(0)])
    z = dt.distribute_tensor(torch.zeros(4, 4, dtype=torch.int64), mesh, [Shard(0)])
    a = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    for _ in range(3):  # the first call of each op is planned; the later ones are fast-path hits
        ok = i // 2 + 1
        w = a * 2.0
    dt.sync()
    before = _chains_ran()
    bad = i // z  # integer division by zero raises in the local kernel
    worse = bad + 1  # poisoned by the chain step before it
    w = a * 2.0  # unrelated: fine
    with pytest.raises(KernelError, match=r"(?s)aten\.floor_divide.*(?i:zero)"):
        worse.full_tensor()
    torch.testing.assert_close(w.full_tensor(), a.full_tensor() * 2.0)
    torch.testing.assert_close(ok.full_tensor(), torch.arange(1, 17).view(4, 4) // 2 + 1)
    assert _chains_ran() > before


@pytest.mark.skipif(native_extension() is None, reason="the native worker loop is not built here")
def test_native_entries_are_given_back_at_shutdown() -> None:
    module = native_extension()
    assert module is not None
    dt.shutdown()
    before = module.live()
    mesh = dt.init_device_mesh("cpu", (2,))
    a = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    for _ in range(3):
        a = a * 2.0 + 1.0
    dt.sync()
    assert module.live() > before
    dt.shutdown()
    assert module.live() == before


@pytest.mark.skipif(native_extension() is None, reason="the native worker loop is not built here")
def test_ops_reading_what_the_chain_just_made_stay_in_the_chain(mesh: dt.DeviceMesh) -> None:
    """``x = x * 0.5 + b``: every op reads the output of the op before it, which the pending chain makes (no blob
    yet); they must all run in the native loop, not one in the chain and the next on the Python replay."""
    x0, b0 = torch.randn(8, 4), torch.randn(8, 4)
    x = dt.distribute_tensor(x0, mesh, [Shard(0)])
    b = dt.distribute_tensor(b0, mesh, [Shard(0)])
    for _ in range(3):  # plans, then teaches the fast path
        x = x * 0.5 + b
    dt.sync()
    before = _chains_ran()
    for _ in range(50):
        x = x * 0.5 + b
    dt.sync()
    ref = x0
    for _ in range(53):
        ref = ref * 0.5 + b0
    assert torch.equal(x.full_tensor(), ref)
    assert _chains_ran() - before == 100 * mesh.size()


@pytest.mark.skipif(native_extension() is None, reason="the native worker loop is not built here")
def test_runs_of_hits_and_their_frees_are_queued_by_one_native_call(
    mesh: dt.DeviceMesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's hot lane: a run of resolved hits and the ``Free``s between them (each ``x`` dies as the next is
    made) is queued on the chain by one C++ call (``NativeChain.queue_runs``), not by Python per instruction."""
    from torch_dtorch.runtime.native_replay import NativeChain

    calls = {"queue_runs": 0, "queued": 0, "free": 0}
    queue_runs, free = NativeChain.queue_runs, NativeChain.free

    def counting_queue_runs(self: NativeChain, *args: object, **kwargs: object) -> tuple[int, int]:
        out = queue_runs(self, *args, **kwargs)  # type: ignore[arg-type]
        calls["queue_runs"] += 1
        calls["queued"] += out[1]
        return out

    def counting_free(self: NativeChain, ids: list[int]) -> None:
        calls["free"] += 1
        free(self, ids)

    x0, b0 = torch.randn(8, 4), torch.randn(8, 4)
    x = dt.distribute_tensor(x0, mesh, [Shard(0)])
    b = dt.distribute_tensor(b0, mesh, [Shard(0)])
    for _ in range(3):  # plans, then teaches the fast path; the workers resolve
        x = x * 0.5 + b
    dt.sync()
    monkeypatch.setattr(NativeChain, "queue_runs", counting_queue_runs)
    monkeypatch.setattr(NativeChain, "free", counting_free)
    executor = get_session().executor
    flushes = executor.num_flushes
    for _ in range(50):
        x = x * 0.5 + b
    dt.sync()
    batches = executor.num_flushes - flushes
    ref = x0
    for _ in range(53):
        ref = ref * 0.5 + b0
    assert torch.equal(x.full_tensor(), ref)
    assert calls["queued"] == 100 * mesh.size()
    # a call per batch and device, and one more where a batch's first instruction is a Free (the Python loop
    # takes it, then the lane goes on)
    assert 0 < calls["queue_runs"] <= 2 * batches * mesh.size(), (calls, batches)
    assert calls["free"] <= batches * mesh.size(), (
        calls,
        batches,
    )  # the Frees between hits never reach Python


@pytest.mark.skipif(native_extension() is None, reason="the native worker loop is not built here")
def test_tensor_lists_and_reductions_run_in_the_native_loop(mesh: dt.DeviceMesh) -> None:
    """``stack``/``cat`` take a ``Tensor[]``: the native loop builds the list from the chain's tensors; a reduction
    whose rank holds the reduced dim is the op itself."""
    a0, b0 = torch.randn(6, 4), torch.randn(6, 4)
    a = dt.distribute_tensor(a0, mesh, [Shard(0)])
    b = dt.distribute_tensor(b0, mesh, [Shard(0)])

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.stack([x * 2.0, y], dim=0).sum(0), y], dim=1)

    for _ in range(3):
        step(a, b)
    dt.sync()
    before = _chains_ran()
    for _ in range(10):
        out = step(a, b)
    dt.sync()
    assert torch.equal(out.full_tensor(), step(a0, b0))
    assert _chains_ran() - before == 40 * mesh.size()


def _general() -> dict[str, int]:
    out: dict[str, int] = {}
    for w in get_session().executor.runner.workers.values():
        for k, v in w.general.items():
            out[k] = out.get(k, 0) + v
    return out


def test_a_view_resolves_to_reshape_and_shares_the_shards_storage() -> None:
    """``view``'s kernel is ``reshape`` locally (a view where the shard's strides allow, else a copy): the resolved
    call runs ``reshape``, so a viewable shard's output aliases it exactly as the general path's does."""
    x = Operand(1, (8, 4), torch.float32, None, None, None, None, [], None, None, False, None, None)
    for op in (aten.view.default, aten._unsafe_view.default):
        call = OpCall(op, (x, [32]), {}, [x], None, [None])
        call.out_meta = get_rule(op).infer_meta(call)
        ctx = LocalContext(
            device=0, coordinate=(), in_shapes=[(8, 4)], out_shapes=[(32,)], out_offsets=[(0,)]
        )
        local = resolve(get_rule(op), call, ctx)
        assert isinstance(local, LocalCall) and local.op is aten.reshape.default
        t = torch.randn(8, 4)
        out = local.run([t])[0]
        assert out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        strided = torch.randn(4, 8).t()  # not viewable as [32]: a copy, as the general path's fallback
        torch.testing.assert_close(local.run([strided])[0], strided.reshape(32))


def test_views_and_in_place_ops_replay_on_the_workers(mesh: dt.DeviceMesh) -> None:
    """Views, ``squeeze.dim`` and in-place ops (fast-path hits) are replayed, not run on the general path; a
    replayed view shares its base's shard, so an in-place write into the base shows through it."""
    a = torch.randn(6, 1, 4)
    x = dt.distribute_tensor(a.clone(), mesh, [Shard(0)])
    y = dt.distribute_tensor(torch.ones(6, 1, 4), mesh, [Shard(0)])
    ref = a.clone()
    for _ in range(3):
        v = x.view(6, 4)
        s = x.squeeze(1)
        x.add_(y)
        x.mul_(2.0)
        ref.add_(1.0).mul_(2.0)
    dt.sync()
    general = _general()
    for name in ("aten.view", "aten.squeeze.dim", "aten.add_.Tensor", "aten.mul_.Tensor"):
        assert general.get(name, 0) <= 2, (name, general)  # the first (full-path) calls only
    torch.testing.assert_close(v.full_tensor(), ref.view(6, 4))
    torch.testing.assert_close(s.full_tensor(), ref.squeeze(1))
    torch.testing.assert_close(x.full_tensor(), ref)
