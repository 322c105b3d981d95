"""TensorChecker: registration of torch / numpy / dtorch values, the three modes, dumps, the neighbourhood."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import torch_dtorch as dt
from tests.tools.conftest import init_mesh
from torch_dtorch.tools import TensorChecker, TensorCheckError


def _pair() -> tuple[TensorChecker, TensorChecker, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(3, 10)
    a, b = TensorChecker("test"), TensorChecker("ref")
    for ck in (a, b):
        ck.register("same", x)
    y = x.clone()
    y[1, 6] += 1e-3
    a.register("close", y)
    b.register("close", x)
    z = x.clone()
    z[2, 4] += 1.0
    a.register("far", z)
    b.register("far", x)
    return a, b, x


def test_modes_and_neighbourhood() -> None:
    a, b, x = _pair()
    eq = a.compare(b, mode="equal")
    assert [r.ok for r in eq] == [True, False, False] and not eq.ok
    close = a.compare(b, mode="allclose", rtol=0, atol=1e-2)
    assert [r.ok for r in close] == [True, True, False]
    far = close.results[2]
    assert far.max_abs_error == pytest.approx(1.0, rel=1e-5)
    assert "first at [2, 4]" in far.neighbourhood and "*[4]" in far.neighbourhood
    assert " [1] " in far.neighbourhood  # unchanged neighbours are shown, unmarked
    assert "first difference in far" in str(close)
    # one element off by 1 in 30: the mean error passes a loose meanclose, allclose does not
    mean = a.compare(b, mode="meanclose", rtol=0.1, atol=0)
    assert [r.ok for r in mean] == [True, True, True]
    assert not a.compare(b, mode="meanclose", rtol=1e-4, atol=0).ok


def test_dump_modes(tmp_path: Path) -> None:
    a, b, x = _pair()
    for mode, count in (("none", 0), ("all", 6), ("not-equal", 4), ("first-not-equal", 2)):
        rep = a.compare(b, mode="equal", dump=mode, dump_dir=tmp_path / mode)
        assert len(rep.dumped) == count, mode
    first = a.compare(b, mode="equal", dump="first-not-equal", dump_dir=tmp_path / "f")
    assert sorted(p.name for p in first.dumped) == ["close.npy", "close.npy"]
    np.testing.assert_array_equal(np.load(tmp_path / "f" / "ref" / "close.npy"), x.numpy())
    with pytest.raises(TensorCheckError, match="dump_dir"):
        a.compare(b, dump="all")
    with pytest.raises(TensorCheckError, match="mode"):
        a.compare(b, mode="nearly")


def test_register_numpy_dtorch_copies_and_mismatches() -> None:
    mesh = init_mesh((2,))
    x = torch.arange(8.0).reshape(2, 4)
    a, b = TensorChecker("dtorch"), TensorChecker("numpy")
    d = dt.distribute_tensor(x, mesh, [dt.Shard(1)])
    a.register("x", d)
    b.register("x", x.numpy())
    a.register("shape", torch.zeros(2))
    b.register("shape", torch.zeros(3))
    a.register("only_a", x)
    src = torch.ones(2)
    b.register("copy", src)
    src += 1  # registered values are copies
    a.register("copy", torch.ones(2))
    rep = a.compare(b, mode="equal")
    assert {r.tag: r.ok for r in rep} == {"x": True, "shape": False, "copy": True}
    assert "shape [2] vs [3]" in rep.results[1].reason
    assert rep.missing == ["only_a"]
    with pytest.raises(TensorCheckError, match="twice"):
        a.register("x", x)
