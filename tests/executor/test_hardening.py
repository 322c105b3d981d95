"""Hardening (issue 18), controller side: options given as paths, dtype errors at the call, memory pre-check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import torch_dtorch as dt
from tests.backend.models import distribute_module
from torch_dtorch.backend.options import CompileOptions, CompileOptionsError, FileSink


@pytest.mark.parametrize("as_path", [str, Path])
def test_debug_backend_file_option_accepts_a_path(tmp_path: Path, as_path: type) -> None:
    target = tmp_path / "graphs.txt"
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = torch.randn(2, 4)
    with torch.no_grad():
        ref = model(x)
        mesh = dt.init_device_mesh("cpu", (2,))
        distribute_module(model, mesh)
        compiled = torch.compile(model, backend="dtorch_debug", options={"file": as_path(target)})
        y = compiled(dt.distribute_tensor(x, mesh, [Replicate()]))
        torch.testing.assert_close(y.full_tensor(), ref)
    text = target.read_text()
    assert "captured aten graph" in text and "LogicalGraph" in text


def test_file_option_errors(tmp_path: Path) -> None:
    opts = CompileOptions.parse({"file": str(tmp_path / "a.txt")}, backend="dtorch_debug")
    assert opts.file == FileSink(tmp_path / "a.txt")
    with pytest.raises(CompileOptionsError, match="directory must exist"):
        CompileOptions.parse({"file": tmp_path / "missing" / "a.txt"}, backend="dtorch_debug")
    with pytest.raises(CompileOptionsError, match="directory must exist"):
        CompileOptions.parse({"file": tmp_path}, backend="dtorch_debug")
    with pytest.raises(CompileOptionsError, match=r"a path \(str or os.PathLike\) or have a write"):
        CompileOptions.parse({"file": 3}, backend="dtorch_debug")


# --- (b) dtype errors at the call, with torch's type and message ------------------------------------------------

_DTYPE_CASES = {
    "int @ float": lambda a, b, m: a @ b,
    "mm int float": lambda a, b, m: torch.mm(a, b),
    "linear int float": lambda a, b, m: torch.nn.functional.linear(b, a),
    "bool & float": lambda a, b, m: m & b,
    "float | float": lambda a, b, m: b | b,
    "int // 0": lambda a, b, m: a // 0,
    "int % 0": lambda a, b, m: a % 0,
    "int ** -1": lambda a, b, m: a**-1,
}


@pytest.mark.parametrize("name", list(_DTYPE_CASES))
def test_dtype_errors_are_raised_at_the_call_like_torch(name: str) -> None:
    fn = _DTYPE_CASES[name]
    a, b, m = torch.arange(16).reshape(4, 4), torch.randn(4, 4), torch.rand(4, 4) > 0.5
    with pytest.raises(Exception) as ref:
        fn(a, b, m)
    mesh = dt.init_device_mesh("cpu", (2,))
    da, db, dm = (dt.distribute_tensor(t, mesh, [Shard(0)]) for t in (a, b, m))
    with pytest.raises(type(ref.value)) as got:
        fn(da, db, dm)  # raised here, not at a later fetch
    assert str(got.value).startswith(str(ref.value).split("\n")[0]), (got.value, ref.value)
    assert "refused at the call" in str(got.value) or "shape inference failed" in str(got.value)
    # nothing was queued: the mesh and the operands stay usable
    torch.testing.assert_close((da + 1).full_tensor(), a + 1)


def test_dtype_probe_accepts_what_torch_accepts() -> None:
    a, b = torch.arange(1, 17).reshape(4, 4), torch.randn(4, 4)
    mesh = dt.init_device_mesh("cpu", (2,))
    da, db = (dt.distribute_tensor(t, mesh, [Shard(0)]) for t in (a, b))
    divisor = dt.distribute_tensor(torch.full((4, 4), 3), mesh, [Shard(0)])
    for got, want in (
        (da // divisor, a // 3),
        (da % 5, a % 5),
        (da * db, a * b),
        (da.float() @ db, a.float() @ b),
        (torch.mvlgamma(db.abs() + 2, 3), torch.mvlgamma(b.abs() + 2, 3)),
        (da**2, a**2),
        (db / 0, b / 0),
    ):
        torch.testing.assert_close(got.full_tensor(), want)


def test_value_dependent_division_by_zero_still_raises_at_fetch() -> None:
    from torch_dtorch.errors import DTorchError

    mesh = dt.init_device_mesh("cpu", (2,))
    da = dt.distribute_tensor(torch.arange(4), mesh, [Shard(0)])
    zero = dt.distribute_tensor(torch.zeros(4, dtype=torch.int64), mesh, [Shard(0)])
    y = da // zero  # the divisor's values are on the workers: not knowable at the call
    with pytest.raises(DTorchError, match="ZeroDivisionError"):
        y.full_tensor()


# --- (a) memory pre-check ---------------------------------------------------------------------------------------


def _fake_pool(mesh_devices: tuple[int, ...], free: int, *, idle: bool = False) -> object:
    from torch_dtorch.executor.memory_check import MemoryGuard, MemoryPool

    guard = MemoryGuard([MemoryPool("fake RAM", mesh_devices, lambda: free)], margin=0.0, idle=lambda: idle)
    constructor = dt.device.state.get_session().executor.constructor
    _REAL_GUARD.setdefault(id(constructor), constructor.memory)
    constructor.memory = guard
    return guard


#: the guard each session's constructor had before a test swapped in a fake one (restored by ``_restore_guard``)
_REAL_GUARD: dict[int, object] = {}


def _restore_guard() -> None:
    constructor = dt.device.state.get_session().executor.constructor
    constructor.memory = _REAL_GUARD.pop(id(constructor), constructor.memory)  # type: ignore[assignment]


def test_factory_larger_than_host_ram_is_refused_before_anything_is_sent() -> None:
    from torch_dtorch.errors import DeviceMemoryError
    from torch_dtorch.executor.memory_check import host_available_bytes

    avail = host_available_bytes()
    assert avail is not None
    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    rows = avail // (4 * 1024) + 1  # one replica alone is larger than the available RAM
    ex = dt.device.state.get_session().executor
    flushes, pending = ex.num_flushes, list(ex._pending)
    with pytest.raises(torch.OutOfMemoryError) as e:
        dt.ones(rows, 1024, device_mesh=mesh, placements=[Replicate()])
    err = e.value
    assert isinstance(err, DeviceMemoryError) and err.op == "aten.ones.default" and err.pool == "host RAM"
    text = str(err)
    assert f"float32[{rows}, 1024] R" in text and "per device on devices [0, 1]" in text and "is free" in text
    assert err.need_bytes == 2 * rows * 1024 * 4 and err.free_bytes > 0
    assert ex.num_flushes == flushes and ex._pending == pending  # nothing was queued or sent
    torch.testing.assert_close((x * 2).full_tensor(), torch.arange(6.0) * 2)  # the mesh and x still work


def test_memory_check_covers_outputs_uploads_and_redistributes() -> None:
    from torch_dtorch.errors import DeviceMemoryError

    mesh = dt.init_device_mesh("cpu", (2,))
    x = dt.distribute_tensor(torch.randn(256, 256), mesh, [Shard(0)])  # 128 KiB per device
    w = dt.distribute_tensor(torch.randn(256, 512), mesh, [Replicate()])
    _fake_pool((0, 1), 400 << 10)  # each of the three below needs 512 KiB or more on the two devices
    try:
        with pytest.raises(DeviceMemoryError, match=r"upload: not enough memory on fake RAM"):
            dt.distribute_tensor(torch.randn(512, 512), mesh, [Replicate()])  # 2 x 1 MiB
        with pytest.raises(DeviceMemoryError, match=r"(?s)redistribute: .*-> R: 256.00 KiB per device"):
            x.redistribute(mesh, [Replicate()])  # 2 x 256 KiB + ...
        with pytest.raises(
            DeviceMemoryError, match=r"aten.mm.default: [^\n]*\n *output 0: float32\[256, 512\] S\(0\)"
        ):
            torch.mm(x, w)
    finally:
        _restore_guard()
    torch.testing.assert_close((x + 0).full_tensor().shape, torch.Size([256, 256]))


def test_planned_bytes_accumulate_until_freed_or_idle() -> None:
    from torch_dtorch.errors import DeviceMemoryError

    mesh = dt.init_device_mesh("cpu", (2,))
    guard = _fake_pool((0, 1), 1 << 20)
    try:
        a = dt.zeros(256, 256, device_mesh=mesh, placements=[Replicate()])  # 2 x 256 KiB: fits
        with pytest.raises(DeviceMemoryError, match="planned and not yet allocated"):
            dt.zeros(256, 256, 2, device_mesh=mesh, placements=[Replicate()])  # 2 x 512 KiB more: not
        del a  # its bytes are no longer planned once its free is queued
        dt.device.state.get_session().executor.flush()
        b = dt.zeros(256, 256, 2, device_mesh=mesh, placements=[Replicate()])
        assert guard.planned() == {"fake RAM": 1 << 20}
        del b
    finally:
        _restore_guard()
    idle = _fake_pool((0, 1), 1 << 20, idle=True)  # the workers are idle: the live figure shows everything
    try:
        keep = [dt.zeros(256, 256, device_mesh=mesh, placements=[Replicate()]) for _ in range(4)]
        assert len(keep) == 4 and idle.checks == 4
    finally:
        _restore_guard()


def test_memory_margin_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_dtorch.executor.memory_check import MemoryGuard, memory_guard_for

    monkeypatch.setenv("DTORCH_MEMORY_MARGIN", "0.25")
    assert MemoryGuard([]).margin == 0.25
    monkeypatch.setenv("DTORCH_MEMORY_MARGIN", "2")
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        MemoryGuard([])
    monkeypatch.setenv("DTORCH_MEMORY_CHECK", "0")
    assert memory_guard_for(object()) is None
