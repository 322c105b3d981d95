"""Hardening (issue 18), controller side: options given as paths, dtype errors at the call, memory pre-check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Replicate

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
