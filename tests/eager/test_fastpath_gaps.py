"""The two worker hot-path gaps of issue 20: ops whose inputs repeat (``x * x``, ``torch.add(x, x)``,
``torch.mm(a, a)``) are resolved and replayed on the workers, and a plain 0-d CPU tensor used as a per-step scalar
(a diffusion timestep) takes the fast path when only its value changes (its dtype is in the key, its value is not).
Every result equals plain torch on the same inputs; the thread-mode tests fail when an op falls back to the
workers' general path (``Worker.general``) or is planned in full (``GraphConstructor.num_planned``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.eager.conftest import MESH_SHAPES, TEST_MODE, init_mesh, mesh_ids, thread_only
from torch_dtorch import Partial, Replicate, Shard
from torch_dtorch.device import binding
from torch_dtorch.device.state import get_session


def _workers(mesh: dt.DeviceMesh) -> list[Any]:
    """The mesh's worker objects (thread mode; none in process mode, where the workers are other processes)."""
    workers = getattr(get_session().executor.runner, "workers", {})
    return [w for w in workers.values() if w.device in mesh.devices]


def _general(mesh: dt.DeviceMesh) -> Counter[str]:
    """Ops run on the general local path so far, summed over the mesh's workers."""
    dt.sync()
    return sum((Counter(w.general) for w in _workers(mesh)), Counter())


def _planned() -> int:
    return get_session().executor.constructor.num_planned  # type: ignore[no-any-return]


def _placements(mesh: dt.DeviceMesh, kind: str) -> list[Any]:
    one = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial()}[kind]
    return [one] + [Replicate()] * (mesh.ndim - 1)


REPEATED: list[tuple[str, Callable[[Any], Any]]] = [
    ("mul", lambda x: x * x),
    ("add_alpha", lambda x: torch.add(x, x, alpha=2)),
    ("sub", lambda x: torch.sub(x, x)),
    ("mm", lambda x: torch.mm(x, x)),
    ("addcmul", lambda x: torch.addcmul(x, x, x, value=0.5)),
    ("where", lambda x: torch.where(x > 0, x, x * 0.5)),
    ("cat", lambda x: torch.cat([x, x], dim=1)),
]


@pytest.mark.parametrize("shape", MESH_SHAPES, ids=mesh_ids)
@pytest.mark.parametrize("kind", ["R", "S0", "S1"])
@pytest.mark.parametrize(("name", "fn"), REPEATED, ids=[c[0] for c in REPEATED])
def test_repeated_inputs_replay_and_equal_torch(
    name: str, fn: Callable[[Any], Any], kind: str, shape: tuple[int, ...]
) -> None:
    # (along the sharded dim ``cat`` exchanges: the general path's, rightly)
    if name == "cat" and kind == "S1":
        fn = lambda x: torch.cat([x, x], dim=0)  # noqa: E731
    mesh = init_mesh(shape)
    a = torch.randn(5, 5)  # uneven over 2, 3 and 4 devices
    x = dt.distribute_tensor(a, mesh, _placements(mesh, kind))
    want = fn(a)
    fn(x)  # the first call plans
    fn(x)  # the first hit resolves it on the workers
    general, planned = _general(mesh), _planned()
    for _ in range(3):
        got = fn(x)
        assert torch.equal(dt.to_torch(got), want) or torch.allclose(dt.to_torch(got), want), name
    assert _planned() == planned, f"{name}: a repeated call planned in full"
    assert _general(mesh) == general, (
        f"{name}: the workers ran it on their general path: {_general(mesh) - general}"
    )


@thread_only
def test_repeated_inputs_replay_in_the_native_chain() -> None:
    """``x * x`` after ``x * y`` (one plan): both replay, and through the native chain when it is built."""
    mesh = init_mesh((2,))
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    x, y = (dt.distribute_tensor(t, mesh, [Shard(0)]) for t in (a, b))
    workers = _workers(mesh)
    x * y
    x * x
    dt.sync()
    ran = [w._chain.ran if w._chain is not None else 0 for w in workers]
    general = _general(mesh)
    out = x * x
    out = out * y
    out = out * out
    assert torch.equal(dt.to_torch(out), ((a * a) * b) * ((a * a) * b))
    assert _general(mesh) == general
    for w, n in zip(workers, ran, strict=True):
        if w._chain is not None:
            assert w._chain.ran >= n + 3


# --- 0-d CPU tensors as per-step scalars -----------------------------------------------------------------------
SCALAR_CASES: list[tuple[str, torch.dtype, Callable[[float], torch.Tensor], Callable[[Any, Any], Any]]] = [
    ("float_mul", torch.float32, lambda v: torch.tensor(v), lambda x, t: x * t),
    ("scalar_first", torch.float32, lambda v: torch.tensor(v), lambda x, t: t * x + x),
    ("int_times_float", torch.int64, lambda v: torch.tensor(v), lambda x, t: x * t),  # float32 (0-d promotes)
    ("int_times_double", torch.int32, lambda v: torch.tensor(v, dtype=torch.float64), lambda x, t: x * t),
    ("half_stays_half", torch.float16, lambda v: torch.tensor(v), lambda x, t: x * t),
    ("float_times_int", torch.float32, lambda v: torch.tensor(int(v * 4)), lambda x, t: x * t),
    ("int32_times_long", torch.int32, lambda v: torch.tensor(int(v * 4)), lambda x, t: x + t),
    ("bool_times_long", torch.bool, lambda v: torch.tensor(int(v * 4)), lambda x, t: x * t),
    ("where", torch.float32, lambda v: torch.tensor(v), lambda x, t: torch.where(x > 0, x, t)),
    ("div_double", torch.float32, lambda v: torch.tensor(v, dtype=torch.float64), lambda x, t: x / t),
]


def _tensor(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 6, generator=g) * 4
    return a > 0 if dtype is torch.bool else a.to(dtype)


@pytest.mark.parametrize("shape", [(1,), (3,), (2, 2)], ids=mesh_ids)
@pytest.mark.parametrize("kind", ["R", "S0", "S1"])
@pytest.mark.parametrize(("name", "dtype", "make", "fn"), SCALAR_CASES, ids=[c[0] for c in SCALAR_CASES])
def test_a_0d_cpu_scalar_with_a_new_value_hits_and_equals_torch(
    name: str,
    dtype: torch.dtype,
    make: Callable[[float], torch.Tensor],
    fn: Callable[[Any, Any], Any],
    kind: str,
    shape: tuple[int, ...],
) -> None:
    mesh = init_mesh(shape)
    a = _tensor(dtype)
    x = dt.distribute_tensor(a, mesh, _placements(mesh, kind))
    fn(x, make(0.25))  # the first call plans
    fn(x, make(0.5))  # the first hit resolves it on the workers
    general, planned = _general(mesh), _planned()
    for v in (0.75, 1.5, -2.25):
        t = make(v)
        want = fn(a, t)
        got = fn(x, t)
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        assert torch.equal(dt.to_torch(got), want), (name, v)
    assert _planned() == planned, f"{name}: a new scalar value planned the call in full"
    assert _general(mesh) == general, f"{name}: the workers ran it on their general path"


def test_a_0d_scalar_on_a_partial_tensor() -> None:
    """``P * t`` stays Partial (the scalar is Replicate); ``P + t`` reduces first: both equal torch per value."""
    mesh = init_mesh((2,))
    a = torch.randn(4, 4)
    x = dt.distribute_tensor(a, mesh, [Partial()])
    for v in (0.5, 2.0, -1.0, 3.0):
        t = torch.tensor(v)
        torch.testing.assert_close(dt.to_torch(x * t), a * v)
        torch.testing.assert_close(dt.to_torch(x + t), a + v)


def test_the_scalars_dtype_is_in_the_key() -> None:
    """A float, a double and an int 0-d scalar on one layout promote differently: three templates."""
    mesh = init_mesh((2,))
    a = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    x = dt.distribute_tensor(a, mesh, [Shard(0)])
    for _ in range(3):
        for t in (torch.tensor(0.5), torch.tensor(0.5, dtype=torch.float64), torch.tensor(3)):
            got = x * t
            assert got.dtype == (a * t).dtype
            assert torch.equal(dt.to_torch(got), a * t)


def test_the_scalar_is_read_at_call_time() -> None:
    """Writing the scalar in place after the call does not change the result (its value is copied)."""
    mesh = init_mesh((2,))
    a = torch.randn(4, 4)
    x = dt.distribute_tensor(a, mesh, [Shard(0)])
    t = torch.tensor(1.0)
    outs, want = [], []
    for v in (2.0, 3.0, 4.0, 5.0):
        t.fill_(v)
        outs.append(x * t)
        want.append(a * v)
    t.fill_(100.0)
    for o, w in zip(outs, want, strict=True):
        assert torch.equal(dt.to_torch(o), w)


@thread_only
def test_scalars_leave_no_blobs_behind() -> None:
    """The scalar's upload is freed after its op, on the fast path and on the full path (it leaked a blob per call
    on every worker before)."""
    mesh = init_mesh((2,))
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    workers = _workers(mesh)
    y = x * torch.tensor(0.5)
    del y
    dt.sync()
    before = [len(w.blobs) for w in workers]
    deferred = len(binding._DEFERRED)
    for v in range(20):
        y = x * torch.tensor(float(v))  # hits
        y = torch.clamp(x, min=torch.tensor(-1.0))  # a tensor keyword: the full path
        del y
    dt.sync()
    assert [len(w.blobs) for w in workers] == before
    assert len(binding._DEFERRED) == deferred


@pytest.mark.skipif(TEST_MODE != "thread", reason="reads the workers' counters")
def test_a_diffusion_like_step_plans_nothing_after_the_first() -> None:
    """A scheduler-like loop: ``x = x + (t_next - t) * v(x)`` with new 0-d CPU timesteps every step."""
    mesh = init_mesh((2,))
    a, w = torch.randn(6, 4), torch.randn(4, 4) * 0.1
    x, dw = dt.distribute_tensor(a, mesh, [Shard(0)]), dt.distribute_tensor(w, mesh, [Replicate()])
    ts = torch.linspace(1.0, 0.0, 7)
    ref = a

    def step(x: Any, w: Any, t: torch.Tensor, dt_: torch.Tensor) -> Any:
        v = torch.tanh(x @ w) * t
        return x + dt_ * v

    for i in range(6):
        t, step_size = ts[i].clone(), (ts[i + 1] - ts[i]).clone()
        if i == 2:
            general, planned = _general(mesh), _planned()
        x = step(x, dw, t, step_size)
        ref = step(ref, w, t, step_size)
    assert _planned() == planned
    assert _general(mesh) == general
    assert torch.equal(dt.to_torch(x), ref)


SDPA_CASES = [  # (name, q placement, causal, whether the workers replay it)
    ("heads", Shard(1), False, True),
    ("heads_causal", Shard(1), True, True),
    ("replicated_causal", Replicate(), True, True),
    ("query_rows", Shard(2), False, True),
    ("query_rows_causal", Shard(2), True, False),  # each rank's rows need their own offset mask
]


@thread_only
@pytest.mark.parametrize(("name", "qp", "causal", "replayed"), SDPA_CASES, ids=[c[0] for c in SDPA_CASES])
def test_attention_replays_on_the_workers(name: str, qp: Any, causal: bool, replayed: bool) -> None:
    """``scaled_dot_product_attention`` without context parallelism is the op itself on every rank's shards: the
    workers replay it (FLUX runs 57 per step, a Llama decode one per layer) — but a causal query shard keeps the
    general path, whose kernel builds the rank's offset mask. Results equal torch either way."""
    mesh = init_mesh((2,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    kvp = qp if qp == Shard(1) else Replicate()
    dq = dt.distribute_tensor(q, mesh, [qp])
    dk, dv = (dt.distribute_tensor(t, mesh, [kvp]) for t in (k, v))

    def fn() -> Any:
        return torch.nn.functional.scaled_dot_product_attention(dq, dk, dv, is_causal=causal)

    fn()
    fn()
    general = _general(mesh)
    for _ in range(2):
        torch.testing.assert_close(dt.to_torch(fn()), want)
    ran_general = (_general(mesh) - general)["aten.scaled_dot_product_attention"]
    assert ran_general == (0 if replayed else 2 * 2), f"{name}: {ran_general} calls on the general path"
