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
