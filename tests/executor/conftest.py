"""Fixtures of the executor tests: an eager executor over a ThreadRunner on a simulated CPU mesh."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from torch_dtorch.executor.eager import EagerGraphExecutor
from torch_dtorch.executor.thread_runner import ThreadRunner
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.runtime import op_runner as kernel_module

MakeExecutor = Callable[..., tuple[EagerGraphExecutor, DeviceMesh]]


@pytest.fixture(autouse=True)
def _clean_hooks() -> Iterator[None]:
    yield
    kernel_module.before_hooks.clear()
    kernel_module.after_hooks.clear()


@pytest.fixture
def make_executor() -> Iterator[MakeExecutor]:
    """``make_executor(mesh_shape, **executor_kwargs)`` -> (executor, mesh); every executor is shut down after."""
    made: list[EagerGraphExecutor] = []

    def make(
        mesh_shape: tuple[int, ...],
        *,
        names: tuple[str, ...] | None = None,
        validate: bool | None = None,
        **kw: object,
    ) -> tuple[EagerGraphExecutor, DeviceMesh]:
        mesh = DeviceMesh.from_shape("cpu", mesh_shape, mesh_dim_names=names)
        ex = EagerGraphExecutor(ThreadRunner(mesh.devices, validate=validate), **kw)  # type: ignore[arg-type]
        made.append(ex)
        return ex, mesh

    yield make
    for ex in made:
        ex.shutdown()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
