"""Sticky errors: a failing kernel poisons its outputs and their dependents (never a hang, never a silent wrong
value), the first dependent fetch raises a typed error naming the op and the worker, unrelated work continues."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.executor.conftest import MakeExecutor
from torch_dtorch.config import Config, get_config
from torch_dtorch.placement import Replicate, Shard
from torch_dtorch.placement_rules import get_rule
from torch_dtorch.runtime import KernelError, KernelIOError

aten = torch.ops.aten


def _fail_on(monkeypatch: pytest.MonkeyPatch, op: Any, device: int) -> None:
    rule = get_rule(op)
    original = rule.kernel

    def kernel(call: Any, ctx: Any, args: Any, kwargs: Any) -> Any:
        if call.op is op and ctx.device == device:
            raise RuntimeError("planted failure")
        return original(call, ctx, args, kwargs)

    monkeypatch.setattr(rule, "kernel", kernel)


def test_kernel_failure_is_sticky_and_named(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_on(monkeypatch, aten.relu.default, device=1)
    ex, mesh = make_executor((2,))
    value = torch.randn(4, 6)
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    bad = ex.call(aten.relu.default, x)  # fails on worker 1 only
    worse = ex.call(aten.mul.Tensor, bad, x)  # poisoned on worker 1, fine on worker 0
    gathered = ex.redistribute(worse, [Replicate()])  # worker 1 joins with zeros; worker 0 must not keep them
    after = ex.call(aten.exp.default, gathered)
    fine = ex.call(aten.sigmoid.default, x)  # unrelated: keeps working
    for y in (bad, worse, gathered, after):
        with pytest.raises(KernelError) as info:
            ex.fetch(y).get(timeout=30)
        msg = str(info.value)
        assert "aten.relu" in msg and "worker 1" in msg and "planted failure" in msg, msg
        assert info.value.op == "aten.relu" and info.value.device == 1
        assert isinstance(info.value.__cause__, RuntimeError)
    torch.testing.assert_close(ex.fetch(fine).get(timeout=30), torch.sigmoid(value))
    # the runtime keeps going after the failure
    again = ex.redistribute(ex.call(aten.neg.default, x), [Replicate()])
    assert torch.equal(ex.fetch(again).get(timeout=30), -value)


@pytest.mark.parametrize("failing", [0, 1])
def test_communicating_kernel_joins_on_zeros_after_a_failure(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch, failing: int
) -> None:
    """A kernel that talks to its peers (here a 2-norm over a sharded dim) whose input is poisoned on one rank: that
    rank still runs it on zeros, so the peer gets its messages (with a 20 s collective timeout a hang would fail the
    test), and both ranks' outputs carry the original error."""
    monkeypatch.setenv("DTORCH_COLLECTIVE_TIMEOUT_S", "20")
    _fail_on(monkeypatch, aten.relu.default, device=failing)
    ex, mesh = make_executor((2,))
    value = torch.randn(6, 4)
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    bad = ex.call(aten.relu.default, x)  # poisoned on one worker only
    norm = ex.call(aten.linalg_vector_norm.default, bad, 2, [0])  # exchanges partial sums between the ranks
    assert norm.placements == (Replicate(),)
    fine = ex.call(aten.linalg_vector_norm.default, x, 2, [0])  # unrelated: the exchange still works
    with pytest.raises(KernelError, match="planted failure") as info:
        ex.fetch(norm).get(timeout=30)
    assert info.value.device == failing
    torch.testing.assert_close(ex.fetch(fine).get(timeout=30), torch.linalg.vector_norm(value, 2, [0]))


def test_communicating_kernel_failing_on_one_rank(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exchange kernel itself raises on worker 1 in the first call (before sending anything): worker 1 joins the
    exchange on zeros and posts the error, so worker 0 neither waits for messages that never come nor takes the
    second call's messages for the first call's (both happened before: a 300 s wait, or a wrong value)."""
    monkeypatch.setenv("DTORCH_COLLECTIVE_TIMEOUT_S", "20")
    rule = get_rule(aten.linalg_vector_norm.default)
    original = rule.kernel
    failures = [1]

    def kernel(call: Any, ctx: Any, args: Any, kwargs: Any) -> Any:
        if ctx.device == 1 and failures and ctx.comm is not None:
            failures.pop()
            raise RuntimeError("planted exchange failure")
        return original(call, ctx, args, kwargs)

    monkeypatch.setattr(rule, "kernel", kernel)
    ex, mesh = make_executor((2,))
    value = torch.randn(6, 4)
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    first = ex.call(aten.linalg_vector_norm.default, x, 2, [0])
    second = ex.call(aten.linalg_vector_norm.default, x, 2, [0])
    with pytest.raises(KernelError, match="planted exchange failure"):
        ex.fetch(first).get(timeout=30)
    torch.testing.assert_close(ex.fetch(second).get(timeout=30), torch.linalg.vector_norm(value, 2, [0]))


def test_call_comm_tags_differ_between_calls() -> None:
    from torch_dtorch.placement_rules.call import LocalContext
    from torch_dtorch.placement_rules.families.context_parallel import device_comm

    sent: list[tuple[int, int]] = []

    class Comm:
        device = 3

        def send(self, t: torch.Tensor, dst: int, tag: int = 0) -> None:
            sent.append((dst, tag))

    def ctx(seq: int | None) -> LocalContext:
        return LocalContext(
            device=0, coordinate=(0,), in_shapes=[], out_shapes=[], out_offsets=[], comm=Comm(), seq=seq
        )

    assert device_comm(ctx(None)).__class__ is Comm  # no call number: the communicator itself (the simulator)
    for seq in (0, 1, 2, 8190):
        device_comm(ctx(seq)).send(torch.ones(1), 1, 0x6E72)
    tags = [tag for _, tag in sent]
    assert len(set(tags)) == 4 and all(t & 0xFFFF == 0x6E72 and 0 < t < 1 << 29 for t in tags)
    assert device_comm(ctx(5)).device == 3  # everything else is the communicator's own
    with pytest.raises(ValueError, match="tags"):
        device_comm(ctx(5)).send(torch.ones(1), 1, 1 << 16)


def test_call_site_with_debug(make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch) -> None:
    _fail_on(monkeypatch, aten.relu.default, device=0)
    monkeypatch.setattr(get_config(), "debug", True)
    ex, mesh = make_executor((2,))
    x = ex.input((4,), mesh, [Shard(0)])
    ex.upload(x, torch.ones(4))
    y = ex.call(aten.relu.default, x)
    with pytest.raises(KernelError, match=r"called from: .*test_errors\.py:\d+ in test_call_site_with_debug"):
        ex.fetch(y).get(timeout=30)


def _bad_view_localize(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant a rule bug: ``view`` keeps a flat local shape instead of the localized sizes."""
    rule = get_rule(aten.view.default)

    def localize(call: Any, ctx: Any) -> Any:
        return (call.args[0], [-1]), dict(call.kwargs)

    monkeypatch.setattr(rule, "localize", localize)


def test_bad_localize_surfaces_at_dependent_fetch(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bad_view_localize(monkeypatch)
    ex, mesh = make_executor((2,), validate=False)
    value = torch.randn(4, 6)
    x = ex.input(value.shape, mesh, [Shard(0)])
    ex.upload(x, value)
    v = ex.call(aten.view.default, x, [4, 6])  # local (12,) instead of (2, 6): no exception here
    y = ex.call(aten.add.Tensor, v, x)  # (12,) + (2, 6) fails on every worker
    with pytest.raises(KernelError, match=r"aten\.add\.Tensor failed on worker \d") as info:
        ex.fetch(y).get(timeout=30)
    assert "size" in str(info.value)
    # a redistribute checks its input shapes before any collective: a typed error, no hang
    z = ex.redistribute(v, [Replicate()])
    with pytest.raises(KernelIOError, match=r"input %\d+ holds float32\[12\].*needs float32\[2, 6\]"):
        ex.fetch(z).get(timeout=30)
    assert torch.equal(ex.fetch(x).get(timeout=30), value)


def test_validate_kernel_io_names_op_rank_expected_actual(
    make_executor: MakeExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bad_view_localize(monkeypatch)
    monkeypatch.setattr(get_config(), "validate_kernel_io", True)
    ex, mesh = make_executor((2,))  # validate=None: read from the config (DTORCH_VALIDATE_KERNEL_IO)
    assert all(w.op_runner.validate for w in ex.runner.workers.values())
    x = ex.input((4, 6), mesh, [Shard(0)])
    ex.upload(x, torch.randn(4, 6))
    v = ex.call(aten.view.default, x, [4, 6])
    with pytest.raises(KernelIOError) as info:
        ex.fetch(v).get(timeout=30)
    msg = str(info.value)
    assert "aten.view failed on worker" in msg and "shape [12], expected [2, 6]" in msg and "rank (" in msg, (
        msg
    )


def test_env_vars_reach_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DTORCH_VALIDATE_KERNEL_IO", "1")
    monkeypatch.setenv("DTORCH_BATCH_SIZE", "17")
    monkeypatch.setenv("DTORCH_FLUSH_MS", "0.5")
    cfg = Config()
    assert cfg.validate_kernel_io and cfg.batch_size == 17 and cfg.flush_ms == 0.5
    monkeypatch.setenv("DTORCH_BATCH_SIZE", "0")
    with pytest.raises(ValueError, match="DTORCH_BATCH_SIZE"):
        Config()


def test_fetch_of_freed_operand_is_an_error(make_executor: MakeExecutor) -> None:
    ex, mesh = make_executor((2,))
    x = ex.input((4,), mesh, [Shard(0)])
    ex.upload(x, torch.ones(4))
    y = ex.call(aten.neg.default, x)
    ex.free(y)
    with pytest.raises(KernelError, match="no data on this worker"):
        ex.fetch(y).get(timeout=30)
    z = ex.call(aten.neg.default, y)
    with pytest.raises(KernelError, match=r"input %\d+ has no data"):
        ex.fetch(z).get(timeout=30)


def test_switch_interval_is_applied_by_thread_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``DTORCH_SWITCH_INTERVAL_MS`` sets the GIL switch interval when thread workers start; a bad value is named."""
    import sys

    from torch_dtorch import config
    from torch_dtorch.executor.thread_runner import ThreadRunner

    before = sys.getswitchinterval()
    monkeypatch.setenv("DTORCH_SWITCH_INTERVAL_MS", "0.25")
    monkeypatch.setattr(config, "_CONFIG", None)
    runner = ThreadRunner([0])
    try:
        assert sys.getswitchinterval() == pytest.approx(0.25e-3)
    finally:
        runner.shutdown()
        sys.setswitchinterval(before)
    monkeypatch.setenv("DTORCH_SWITCH_INTERVAL_MS", "fast")
    monkeypatch.setattr(config, "_CONFIG", None)
    with pytest.raises(ValueError, match="DTORCH_SWITCH_INTERVAL_MS='fast' is not a number"):
        config.get_config()
    monkeypatch.setattr(config, "_CONFIG", None)
