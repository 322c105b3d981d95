"""The native (C++) tensor table and fast kernel (device/_native.cpp), and the pure-Python fallback.

The tests above the fallback section hold for either table; the suite runs them with the native one, and
``test_python_fallback_passes_the_fast_path_tests`` runs them again (with the fast-path and call-key tests) with
``DTORCH_NATIVE=0``.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import init_mesh, thread_only
from torch_dtorch import Replicate, Shard
from torch_dtorch.device import fastpath
from torch_dtorch.device.dispatch import operand_of
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import TABLE

ROOT = Path(__file__).resolve().parents[2]


def test_view_under_inference_mode_is_a_normal_tensor_of_a_normal_base() -> None:
    """As in torch: a view made under ``inference_mode`` of a normal tensor is a normal tensor (autograd links it
    to its base's version counter); anything else made there is an inference tensor. Replays included."""
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    with torch.inference_mode():
        for _ in range(3):
            v, y = x.view(24), x + x
            assert not v.is_inference() and y.is_inference()
            assert y.view(24).is_inference()
    torch.testing.assert_close(v.full_tensor(), x.full_tensor().view(24))


def test_python_numbers_in_tensor_slots_take_the_fast_path() -> None:
    """``x + 1.0`` reaches aten as ``add.Tensor`` with a wrapped 0-d CPU tensor: a constant keyed by dtype and
    value, so repeated calls hit and each value (and type) gets its own template."""
    mesh = init_mesh((2,))
    a = torch.randn(4, 6)
    i = torch.arange(6)
    x = dt.distribute_tensor(a, mesh, [Shard(0)])
    xi = dt.distribute_tensor(i, mesh, [Shard(0)])
    cases = [
        (lambda t: t + 1.0, lambda: x),
        (lambda t: t * 2, lambda: x),
        (lambda t: 3.5 - t, lambda: x),
        (lambda t: t / 7, lambda: xi),
        (lambda t: t + 1, lambda: xi),
        (lambda t: t + True, lambda: xi),
        (lambda t: t * 2.5, lambda: xi),
    ]
    for fn, src in cases:
        d = src()
        ref = a if d is x else i
        fn(d)
        before = dict(fastpath.stats)
        for _ in range(2):
            got = fn(d).full_tensor()
            want = fn(ref)
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want)
        assert fastpath.stats["miss"] == before["miss"], "a repeated call with a Python number missed"
    for k in (1.0, 2.0, -0.5, 1, 0.0, -0.0):  # values never share a template (-0.0 is not 0.0 bitwise)
        torch.testing.assert_close((x + k).full_tensor(), a + k)
        torch.testing.assert_close((x * k).full_tensor(), a * k)


def test_dead_tensors_are_freed_by_the_next_op_or_sync() -> None:
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    freed: list[int] = []
    release = get_session().executor.release
    get_session().executor.release = lambda oid: (freed.append(oid), release(oid))  # type: ignore[method-assign]
    try:
        y = x + x
        oid = operand_of(y).id
        del y
        gc.collect()
        dt.sync()
        assert oid in freed
        z = x * 2
        w = z.view(64)  # a view keeps its base tensor alive (autograd's ``_base``)
        zid, wid = operand_of(z).id, operand_of(w).id
        del z
        x - x
        assert zid not in freed
        del w
        x - x  # the next op frees both
        assert zid in freed and wid in freed
    finally:
        get_session().executor.release = release  # type: ignore[method-assign]


def test_aliases_keep_the_operand_until_the_last_dies() -> None:
    """``detach``, ``nn.Parameter(t)`` and ``.data`` share the storage, so they stand for the same operand."""
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(1)])
    y = x + 1
    p = torch.nn.Parameter(y)
    d = y.detach()
    assert operand_of(p) is operand_of(y) is operand_of(d) is operand_of(p.data)
    want = y.full_tensor()
    del y
    gc.collect()
    dt.sync()
    torch.testing.assert_close((p + d).full_tensor(), want * 2)


def test_threads_issuing_ops_at_once_each_get_their_own_results() -> None:
    mesh = init_mesh((2,))
    base = torch.randn(8, 8)
    shared = dt.distribute_tensor(base, mesh, [Shard(0)])
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            mine = dt.distribute_tensor(torch.full((8, 8), float(k)), mesh, [Replicate()])
            acc = shared * 0
            for _ in range(200):
                acc = acc + mine
                acc.view(64)
            # (threads do not inherit the main thread's default device: compare on the CPU)
            torch.testing.assert_close(acc.full_tensor().cpu(), torch.full((8, 8), 200.0 * k, device="cpu"))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_stale_and_foreign_tensors_are_refused_clearly() -> None:
    from torch_dtorch.device.tensors import StaleTensorError

    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    assert TABLE.entry(torch.randn(2)) is None  # a CPU tensor is not in the table
    gen = get_session().generation
    with pytest.raises(StaleTensorError, match="restarted"):
        TABLE.lookup(x, gen + 1)


def test_a_restarted_pool_refuses_old_tensors_even_on_cached_calls() -> None:
    from torch_dtorch.device.tensors import StaleTensorError

    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    for _ in range(2):
        x + x  # cached
    dt.shutdown()
    init_mesh((2,))  # a new pool: nothing was wrapped on it yet
    with pytest.raises(StaleTensorError, match="restarted"):
        x + x


# --- native only -------------------------------------------------------------------------------------------------

native_only = pytest.mark.skipif(
    not TABLE.native, reason="runs with the native table (this run is the DTORCH_NATIVE=0 fallback)"
)


@native_only
def test_native_kernel_serves_repeated_calls() -> None:
    """Plain, view and composite (matmul) ops hit in C++ from the second call on: the kernel learned each call's
    template from the Python path."""
    mesh = init_mesh((2,))
    a = dt.distribute_tensor(torch.randn(6, 6), mesh, [Shard(0)])
    b = dt.distribute_tensor(torch.randn(6, 6), mesh, [Replicate()])
    for fn in (lambda: a + b, lambda: a.view(36), lambda: a @ b, lambda: a.sum(1), lambda: a.split(2, dim=1)):
        fn()
        before = TABLE._m.stats()  # type: ignore[union-attr]
        for _ in range(3):
            fn()
        after = TABLE._m.stats()  # type: ignore[union-attr]
        assert after["hit"] - before["hit"] == 3 and after["miss"] == before["miss"], (before, after)
    torch.testing.assert_close((a @ b).full_tensor(), a.full_tensor() @ b.full_tensor())


@native_only
def test_attention_and_casts_that_stay_on_dtorch_hit_in_cpp() -> None:
    """SDPA without grad (an inference step; its own autograd kernel sits behind a native gate) and the ``to``
    overloads whose target is dtorch hit in C++; ``to`` that leaves dtorch still gathers, and SDPA under grad still
    takes the attention's own autograd."""
    mesh = init_mesh((2,))
    q = dt.distribute_tensor(torch.randn(2, 4, 3, 8), mesh, [Shard(1)])
    k = dt.distribute_tensor(torch.randn(2, 4, 5, 8), mesh, [Shard(1)])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = (
        lambda: sdpa(q, k, k, scale=0.3),
        lambda: q.to("dtorch"),
        lambda: q.to(torch.float64),
        lambda: q.to("dtorch", torch.float16),
        lambda: q.to(q),
        lambda: torch.ops.aten._to_copy.default(q, dtype=torch.float64),
    )
    with torch.no_grad():
        for fn in calls:
            fn()
            before = TABLE._m.stats()  # type: ignore[union-attr]
            for _ in range(3):
                fn()
            after = TABLE._m.stats()  # type: ignore[union-attr]
            assert after["hit"] - before["hit"] == 3 and after["miss"] == before["miss"], (fn, before, after)
        want = sdpa(q.full_tensor(), k.full_tensor(), k.full_tensor(), scale=0.3)
        torch.testing.assert_close(sdpa(q, k, k, scale=0.3).full_tensor(), want)
        torch.testing.assert_close(q.to("dtorch", torch.float16).full_tensor(), q.full_tensor().half())
        left = q.to("cpu")
        assert left.device.type == "cpu"
        torch.testing.assert_close(left, q.full_tensor())
    qg = q.detach().requires_grad_()
    out = sdpa(qg, k, k, scale=0.3)
    assert out.grad_fn is not None and "Attention" in type(out.grad_fn).__name__
    out.sum().backward()
    ref = q.full_tensor().requires_grad_()
    sdpa(ref, k.full_tensor(), k.full_tensor(), scale=0.3).sum().backward()
    torch.testing.assert_close(qg.grad.full_tensor(), ref.grad)


@native_only
@pytest.mark.parametrize("pl", [[Replicate()], [Shard(0)], [Shard(1)]], ids=["replicate", "shard0", "shard1"])
def test_native_kernel_serves_tensor_list_ops(pl: list[Any]) -> None:
    """``cat`` (the op's one ``Tensor[]``, keyed by every element's layout and the count) hits in C++ from the
    second call on; another count, order of layouts or ``dim`` is another key; an unbound element (a KV cache's
    ``torch.tensor([])``) takes the Python path. Values equal torch, uneven shards included."""
    mesh = init_mesh((3,))
    a0, b0 = torch.randn(5, 4), torch.randn(5, 2)
    a, b = dt.distribute_tensor(a0, mesh, pl), dt.distribute_tensor(b0, mesh, pl)
    calls = [
        (lambda: torch.cat([a, b], dim=1), torch.cat([a0, b0], dim=1)),
        (lambda: torch.cat([b, a], dim=1), torch.cat([b0, a0], dim=1)),
        (lambda: torch.cat([a, b, a], dim=-1), torch.cat([a0, b0, a0], dim=-1)),
        (lambda: torch.cat([a, a], dim=0), torch.cat([a0, a0], dim=0)),
    ]
    for fn, want in calls:
        fn()
        before = TABLE._m.stats()  # type: ignore[union-attr]
        outs = [fn() for _ in range(3)]
        after = TABLE._m.stats()  # type: ignore[union-attr]
        assert after["hit"] - before["hit"] == 3 and after["miss"] == before["miss"], (before, after)
        for out in outs:
            torch.testing.assert_close(out.full_tensor(), want)
    flat = a.reshape(-1)
    empty = torch.tensor([], device="dtorch")  # unbound until an op binds it: the Python fast path's business
    before = TABLE._m.stats()  # type: ignore[union-attr]
    out = torch.cat([empty, flat])
    assert TABLE._m.stats()["miss"] == before["miss"] + 1  # type: ignore[union-attr]
    torch.testing.assert_close(out.full_tensor(), a0.reshape(-1))


@native_only
def test_native_table_live_count_stays_flat() -> None:
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    x + x
    before = len(TABLE)
    for _ in range(1000):
        x = x + 1
    assert len(TABLE) <= before + 2


@thread_only  # worker processes find rules in their own registry (a run-time rule needs DTORCH_WORKER_IMPORTS)
def test_rule_change_clears_the_cached_templates() -> None:
    """A rule replaced after calls were cached serves the next call (no stale template, native or Python)."""
    from torch_dtorch.placement_rules import register_rule, sig, unregister_rule

    aten = torch.ops.aten
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    for _ in range(2):
        assert x.neg().placements == (Shard(0),)
    good = unregister_rule(aten.neg.default)
    try:
        register_rule(aten.neg.default, family="pointwise")(lambda call: [sig([Replicate()], Replicate())])
        for _ in range(2):
            y = x.neg()
            assert y.placements == (Replicate(),)
            torch.testing.assert_close(y.full_tensor(), -x.full_tensor())
    finally:
        unregister_rule(aten.neg.default)
        register_rule(aten.neg.default, family="pointwise")(good)
    assert x.neg().placements == (Shard(0),)


# --- the fallback ------------------------------------------------------------------------------------------------


def _run(args: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
@native_only
def test_python_fallback_passes_the_fast_path_tests() -> None:
    eager = ["tests/eager/test_native.py", "tests/eager/test_fastpath.py"]
    backend = [
        "tests/backend/test_call_key.py"
    ]  # CPU meshes only: not under the eager suite's DTORCH_TEST_DEVICE
    for files, env in ((eager, {}), (backend, {"DTORCH_TEST_DEVICE": "cpu"})):
        r = _run(
            ["-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *files],
            {"DTORCH_NATIVE": "0", **env},
            600,
        )
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        assert " passed" in r.stdout


@native_only
def test_no_compiler_falls_back_with_one_warning(tmp_path: Path) -> None:
    code = (
        "import logging, torch, torch_dtorch as dt\n"
        "from torch_dtorch.device.tensors import TABLE\n"
        "m = dt.init_device_mesh('cpu', (2,))\n"
        "x = dt.distribute_tensor(torch.arange(4.0), m, [dt.Shard(0)])\n"
        "print(type(TABLE).__name__, (x + x).full_tensor().tolist())\n"
    )
    env = {"DTORCH_NATIVE_DIR": str(tmp_path), "CXX": "/bin/false", "DTORCH_NATIVE": "1"}
    r = _run(["-c", code], env, 300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "TensorTable [0.0, 2.0, 4.0, 6.0]", r.stdout
    assert r.stderr.count("native fast path could not be built") == 1, r.stderr[-3000:]
