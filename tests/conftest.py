"""Test-wide settings: tiny CPU kernels run fastest single-threaded on the 2-core CI machines.

Worker processes (process mode) inherit ``OMP_NUM_THREADS=1``: the same single intra-op thread as this process, so
their CPU reductions add in the same order as the single-device reference (bit-identical results), and two test
processes with their workers do not oversubscribe the two cores."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture
def compiled_graphs(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every ``CompiledGraph`` the ``dtorch`` backend makes during the test, in the order made."""
    from torch_dtorch.backend.compiled import CompiledGraph

    made: list[Any] = []
    init = CompiledGraph.__init__

    def record(self: CompiledGraph, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(CompiledGraph, "__init__", record)
    return made


@pytest.fixture
def symbolic_compiles(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The input specs of every workers' inductor compile of a symbolic-size program during the test (thread
    mode: ``_compat.inductor_compile_symbolic`` runs in this process)."""
    from torch_dtorch import _compat

    compiles: list[Any] = []
    real = _compat.inductor_compile_symbolic

    def counting(gm: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        compiles.append(tuple(inputs))
        return real(gm, inputs, *args, **kwargs)

    monkeypatch.setattr(_compat, "inductor_compile_symbolic", counting)
    return compiles
