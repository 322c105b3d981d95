"""The eager API and the dtorch device: async issue, futures, errors, lifecycle, aliasing, factories, porting."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn.functional as F

import torch_dtorch as dt
from tests.eager.conftest import init_mesh, thread_only
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.device.binding import NoMeshError
from torch_dtorch.device.state import get_session
from torch_dtorch.errors import AsStridedError, NoRuleError
from torch_dtorch.runtime import op_runner as kernel_mod


def mesh4() -> dt.DeviceMesh:
    return init_mesh((4,))


@thread_only
def test_ops_return_before_the_workers_finish() -> None:
    mesh = mesh4()
    x = dt.distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    w = dt.distribute_tensor(torch.randn(8, 8), mesh, [Replicate()])
    dt.sync()

    def slow(instr: object, device: int) -> None:
        time.sleep(0.2)

    kernel_mod.before_hooks.append(slow)
    try:
        t0 = time.perf_counter()
        y = x @ w
        issued = time.perf_counter() - t0
        fut = dt.to_torch_async(y)
        assert not fut.is_ready()
        assert not fut.wait_for(50)
        got = fut.get()
        total = time.perf_counter() - t0
    finally:
        kernel_mod.before_hooks.remove(slow)
    assert issued < 0.1 < 0.2 <= total, (issued, total)
    torch.testing.assert_close(got, x.full_tensor() @ w.full_tensor())


def test_futures_resolve_in_order_and_await() -> None:
    import asyncio

    mesh = mesh4()
    xs = [dt.distribute_tensor(torch.full((5,), float(i)), mesh, [Shard(0)]) for i in range(20)]
    futs = [dt.to_torch_async(x * 2) for x in xs]
    done: list[int] = []
    for i, f in enumerate(futs):
        f.add_done_callback(lambda _f, i=i: done.append(i))
    assert [f.get()[0].item() for f in futs] == [2.0 * i for i in range(20)]
    assert done == sorted(done)

    async def main() -> torch.Tensor:
        return await dt.to_torch_async(xs[3] + 1)

    assert asyncio.run(main())[0].item() == 4.0


@thread_only
def test_kernel_failure_is_sticky_and_named_and_unrelated_work_continues(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch_dtorch.placement_rules import get_rule

    mesh = mesh4()
    x = dt.distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)])
    ok = dt.distribute_tensor(torch.ones(4), mesh, [Replicate()])
    rule = get_rule(torch.ops.aten.sigmoid.default)

    def broken(call, ctx, args, kwargs):  # noqa: ANN001, ANN202
        if ctx.device == 2:
            raise RuntimeError("planted failure")
        return call.op(*args, **kwargs)

    monkeypatch.setattr(rule, "_kernel", broken)
    bad = torch.sigmoid(x)
    worse = (bad * 2).sum(0)  # depends on the failed op: poisoned, never runs
    dt.sync()  # errors stay with their tensors: sync does not raise
    monkeypatch.undo()
    with pytest.raises(dt.errors.DTorchError, match=r"aten\.sigmoid") as e:
        worse.full_tensor()
    assert "planted failure" in str(e.value) and "worker 2" in str(e.value)
    torch.testing.assert_close((ok + 1).full_tensor(), torch.full((4,), 2.0))
    torch.testing.assert_close(torch.sigmoid(x).full_tensor(), torch.sigmoid(x.full_tensor()))


@thread_only
def test_freed_operands_do_not_accumulate() -> None:
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(16, 16), mesh, [Shard(0)])
    ex = get_session().executor
    dt.sync()
    workers = ex.runner.workers
    before = max(len(w.blobs) for w in workers.values())
    y, want = x, x.full_tensor()
    for _ in range(10_000):
        y = torch.relu(y + 0.001)
        want = torch.relu(want + 0.001)
    dt.sync()
    gc.collect()
    dt.sync()
    after = max(len(w.blobs) for w in workers.values())
    assert after <= before + 8, (before, after)
    torch.testing.assert_close(y.full_tensor(), want)


@thread_only
def test_redistributed_input_copies_are_freed() -> None:
    """An op whose input is redistributed first (Shard + Replicate add: the replicated operand is sliced) makes a
    copy nothing refers to: it is freed after the op, on the full path (first call) and the fast path (later
    calls); a view of a moved input keeps its copy alive until the view dies."""
    mesh = init_mesh((4,))
    a = dt.distribute_tensor(torch.randn(16, 16), mesh, [Shard(0)])
    b = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
    workers = get_session().executor.runner.workers
    dt.sync()
    before = max(len(w.blobs) for w in workers.values())
    for _ in range(500):
        c = a + b
    torch.testing.assert_close(c.full_tensor(), a.full_tensor() + b.full_tensor())
    del c
    gc.collect()
    dt.sync()
    assert max(len(w.blobs) for w in workers.values()) <= before + 2
    # flattening a Shard(1) operand moves it first; the view keeps that copy alive until the view dies
    s1 = dt.distribute_tensor(torch.randn(16, 16), mesh, [Shard(1)])
    dt.sync()
    before = max(len(w.blobs) for w in workers.values())
    views = [s1.view(256) for _ in range(50)]
    owned = get_session().executor.copy_views
    assert len(owned) == 50
    torch.testing.assert_close(views[-1].full_tensor(), s1.full_tensor().view(256))
    del views
    gc.collect()
    dt.sync()
    assert not owned.records
    assert max(len(w.blobs) for w in workers.values()) <= before + 2


@thread_only
def test_copy_from_plain_tensors_frees_the_old_value() -> None:
    """``load_state_dict``-style ``dtorch_t.copy_(cpu_t)`` rebinds the tensor to an upload: the old value is freed
    on the workers, and an unbound tensor's controller-side value is dropped once it is materialized."""
    mesh = init_mesh((2,))
    p = dt.distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    workers = get_session().executor.runner.workers
    dt.sync()
    before = max(len(w.blobs) for w in workers.values())
    for i in range(100):
        p.copy_(torch.full((8, 8), float(i)))
    torch.testing.assert_close(p.full_tensor(), torch.full((8, 8), 99.0))
    gc.collect()
    dt.sync()
    assert max(len(w.blobs) for w in workers.values()) <= before
    from torch_dtorch.device import binding

    gc.collect()
    others = set(binding._DEFERRED)  # unbound tensors other tests of this session still hold
    u = torch.zeros(3, device="dtorch")
    for i in range(20):
        u.copy_(torch.full((3,), float(i)))
    with mesh:
        u.add_(1)
    assert u.full_tensor().tolist() == [20.0] * 3
    assert set(binding._DEFERRED) <= others  # none of this test's recipes is left


def test_placements_survive_detach_parameter_and_data() -> None:
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    x = dt.distribute_tensor(torch.randn(6, 4), mesh, [Shard(0), Shard(1)])
    p = torch.nn.Parameter(x)
    for t in (x.detach(), p, p.data, x.data):
        assert t.placements == (Shard(0), Shard(1)) and t.device_mesh == mesh
    assert p.requires_grad and p.device.type == "dtorch"
    torch.testing.assert_close(F.linear(torch.ones(3, 4).to("dtorch"), p).full_tensor(),
                               F.linear(torch.ones(3, 4), x.full_tensor()))  # fmt: skip


def test_as_strided_on_sharded_is_a_typed_error_and_fine_on_replicate() -> None:
    mesh = mesh4()
    x = dt.distribute_tensor(torch.arange(12.0), mesh, [Shard(0)])
    with pytest.raises(AsStridedError, match="as_strided on %.*S\\(0\\)"):
        torch.as_strided(x, (3, 2), (1, 3))
    r = dt.distribute_tensor(torch.arange(12.0), mesh, [Replicate()])
    assert torch.equal(
        torch.as_strided(r, (3, 2), (1, 3)).full_tensor(), torch.arange(12.0).as_strided((3, 2), (1, 3))
    )


def test_unsupported_op_names_the_overload() -> None:
    mesh = mesh4()
    x = dt.distribute_tensor(torch.randint(1, 50, (4, 4)), mesh, [Replicate()])
    # gcd has no rule (its structured kernel reaches the device as the ``.out`` overload): the error names it
    with pytest.raises(
        NoRuleError, match=r"(?s)no placement rule for aten\.gcd\.out\b.*register_rule\(aten\.gcd\.out\)"
    ):
        torch.gcd(x, x + 3)


def test_factories_and_unbound_replicate_tensors() -> None:
    mesh = init_mesh((3,))
    z = dt.zeros(7, 2, device_mesh=mesh, placements=[Shard(0)])
    assert z.placements == (Shard(0),) and torch.equal(z.full_tensor(), torch.zeros(7, 2))
    x = dt.distribute_tensor(torch.randn(7, 5), mesh, [Shard(0)])
    # model code creating tensors on x.device: unbound Replicate, bound to x's mesh by its first consumer
    pos = torch.arange(5, device=x.device)
    y = x + pos
    assert y.placements == (Shard(0),)
    torch.testing.assert_close(y.full_tensor(), x.full_tensor() + torch.arange(5))
    with mesh:
        o = torch.ones(3, device="dtorch")
        assert o.device_mesh == mesh and o.placements == (Replicate(),)
    c = torch.tensor([1.0, 2.0]).to("dtorch")
    assert torch.equal((c * 3).full_tensor(), torch.tensor([3.0, 6.0]))
    assert torch.equal(c.cpu(), torch.tensor([1.0, 2.0]).cpu())  # .cpu() leaves the dtorch device


def test_unbound_tensors_compute_on_the_controller_until_a_mesh_appears(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any mesh is in sight (no ``with mesh:``, no op on a mesh yet — e.g. while dynamo traces a model whose
    cache does ``torch.tensor([], device=x.device)``), ops on unbound tensors run on the controller's values and
    stay unbound; the first consumer on a mesh binds them."""
    from torch_dtorch.device.dispatch import operand_of

    mesh = init_mesh((2,))
    monkeypatch.setattr(get_session(), "last_mesh", None)
    e = torch.tensor([], device="dtorch")
    f = torch.cat([e, torch.arange(3.0, device="dtorch")]) * 2
    assert operand_of(f).mesh is None
    # the value is on the CPU (the GPU run's default device is cuda)
    assert torch.equal(f.cpu(), torch.tensor([0.0, 2.0, 4.0], device="cpu"))
    x = dt.distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    y = x + f
    assert y.placements == (Shard(0),)
    assert torch.equal(y.full_tensor(), torch.ones(4, 3) + torch.tensor([0.0, 2.0, 4.0]))
    with pytest.raises(NoMeshError):  # in-place needs a mesh to write on
        monkeypatch.setattr(get_session(), "last_mesh", None)
        f.add_(1)


def test_random_equals_torch_under_the_same_seed() -> None:
    mesh = init_mesh((2, 2))
    torch.manual_seed(7)
    want = [torch.randn(5, 3), torch.rand(4), torch.randn(2, 2)]
    torch.manual_seed(7)
    a = dt.randn(5, 3, device_mesh=mesh, placements=[Shard(0), Shard(1)])
    b = dt.rand(4, device_mesh=mesh, placements=[Replicate(), Shard(0)])
    with mesh:
        c = torch.randn(2, 2, device="dtorch")
    for got, w in zip((a, b, c), want, strict=True):
        assert torch.equal(got.full_tensor(), w)


def test_redistribute_by_dict_and_partial() -> None:
    mesh = init_mesh((2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(5, 6)
    d = dt.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    y = dt.redistribute_by_dict(d, {"tp": Replicate()})
    assert y.placements == (Shard(0), Replicate())
    p = d.redistribute(mesh, [Partial(), Shard(1)])
    torch.testing.assert_close(p.full_tensor(), x)


def test_second_init_reuses_or_restarts_the_pool() -> None:
    a = init_mesh((2,))
    rt = get_session()
    b = init_mesh((2,))
    assert get_session() is rt and a == b
    x = dt.distribute_tensor(torch.ones(2), b, [Shard(0)])
    big = init_mesh((8,))  # more devices than the pool has: a clean restart
    assert get_session() is not rt and big.size() == 8
    with pytest.raises(dt.errors.DTorchError, match="restarted|shut down"):
        x + 1
    dt.shutdown()
    dt.shutdown()  # idempotent
    m = init_mesh((2,))
    assert torch.equal(dt.ones(2, device_mesh=m).full_tensor(), torch.ones(2))


def test_methods_on_plain_tensors_raise_clearly() -> None:
    with pytest.raises(dt.errors.DTorchError, match="only defined for dtorch tensors"):
        _ = torch.ones(2).placements


UPSTREAM_SNIPPET = """
import torch
from {module} import init_device_mesh, distribute_tensor, Shard, Replicate
mesh = init_device_mesh("cpu", (2,))
x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
y = (x * 2).redistribute(mesh, [Replicate()])
result = y.full_tensor()
"""


def test_upstream_code_runs_with_only_the_import_changed() -> None:
    import os
    import subprocess
    import sys

    ours: dict[str, object] = {}
    exec(UPSTREAM_SNIPPET.format(module="torch_dtorch"), ours)
    # the same snippet against torch.distributed.tensor, in a single-rank gloo process group
    code = (
        "import os, torch.distributed as dist\n"
        "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
        + UPSTREAM_SNIPPET.format(module="torch.distributed.tensor").replace("(2,)", "(1,)")
        + "print(result.tolist())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert eval(out.stdout.strip()) == ours["result"].tolist()  # type: ignore[attr-defined]


def test_inplace_ops_write_through_views() -> None:
    mesh = init_mesh((2,))
    x = torch.arange(12.0).reshape(4, 3)
    dx = dt.distribute_tensor(x.clone(), mesh, [Shard(0)])
    v = dx.view(4, 3, 1)
    col = dx[:, 1]  # a view along the unsharded dim: local on every rank
    dx.add_(1)
    col.mul_(10)
    want = x + 1
    want[:, 1] *= 10
    assert torch.equal(dx.full_tensor(), want)
    assert torch.equal(v.full_tensor(), want.view(4, 3, 1))
    out = dt.zeros(4, 3, device_mesh=mesh, placements=[Shard(0)])
    torch.add(dx, 1, out=out)
    assert torch.equal(out.full_tensor(), want + 1)
    # a view that needed a redistribute cannot carry a write back: refused, not silently lost
    row = dx[1]
    with pytest.raises(NotImplementedError, match="redistributed copy"):
        row.mul_(2)


def test_copy_from_a_plain_tensor_and_load_state_dict() -> None:
    """``dtorch_t.copy_(plain)`` uploads in ``dtorch_t``'s placements (broadcasting, casting), as a copy across
    devices does in torch; so ``load_state_dict`` of a plain checkpoint fills a distributed model."""
    mesh = init_mesh((3,))
    x = dt.distribute_tensor(torch.zeros(7, 4, dtype=torch.float64), mesh, [Shard(0)])
    v = torch.randn(7, 4)
    x.copy_(v)
    assert x.placements == (Shard(0),) and x.dtype == torch.float64
    torch.testing.assert_close(x.full_tensor(), v.double())
    row = torch.randn(4)
    x.copy_(row)  # broadcast
    torch.testing.assert_close(x.full_tensor(), row.double().expand(7, 4))

    torch.manual_seed(0)
    plain, model = torch.nn.Linear(4, 5), torch.nn.Linear(4, 5)
    for name, p in list(model.named_parameters()):
        setattr(model, name, torch.nn.Parameter(dt.distribute_tensor(torch.zeros_like(p), mesh, [Shard(0)])))
    model.load_state_dict(plain.state_dict())
    assert model.weight.placements == (Shard(0),)
    inp = torch.randn(2, 4)
    with torch.no_grad():
        got = model(dt.distribute_tensor(inp, mesh, [Replicate()])).full_tensor()
        torch.testing.assert_close(got, plain(inp))


@pytest.mark.parametrize(
    "name, fn",
    [
        ("t_", lambda x: x.t_()),
        ("transpose_", lambda x: x.transpose_(0, 1)),
        ("squeeze_", lambda x: x[:1].squeeze_(0)),
        ("unsqueeze_", lambda x: x.unsqueeze_(0)),
        ("as_strided_", lambda x: x.as_strided_((2, 2), (1, 2))),
    ],
)
def test_inplace_restride_is_a_typed_error(name: str, fn: object) -> None:
    from torch_dtorch.errors import RestrideError

    x = dt.distribute_tensor(torch.randn(4, 3), init_mesh((2,)), [Shard(0)])
    with pytest.raises(RestrideError, match=rf"aten\.{name}: .*x = x\.{name.rstrip('_')}"):
        fn(x)  # type: ignore[operator]
    assert x.shape == (4, 3) and torch.equal(x.full_tensor(), x.full_tensor())
