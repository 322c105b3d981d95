"""A representative subset of the eager suite (``tests/eager``) in process mode, on one shared 4-worker pool (the
CI target; ``DTORCH_TEST_MODE=process pytest tests/eager`` / ``make test-process`` runs the whole suite that way)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

import tests.eager.conftest as eager_conftest
from tests.eager import test_api, test_ops

CASES: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
    (test_ops.test_mlp, ((4,),)),  # the 4-device mesh first: every smaller one reuses its pool
    (test_ops.test_mlp, ((3,),)),
    (test_ops.test_mlp, ((2,),)),
    (test_ops.test_attention_block, ((2, 2),)),
    (test_ops.test_norms_softmax_reductions, ((3,),)),
    (test_ops.test_views_of_sharded_tensors, ((2, 2),)),
    (test_ops.test_every_redistribute_transition_uneven, ((2, 2),)),
    (test_ops.test_partial_from_local_and_to_local, ()),
    (test_api.test_random_equals_torch_under_the_same_seed, ()),
    (test_api.test_factories_and_unbound_replicate_tensors, ()),
    (test_api.test_placements_survive_detach_parameter_and_data, ()),
]


@pytest.fixture(autouse=True, scope="module")
def _process_mode() -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setattr(eager_conftest, "TEST_MODE", "process")
    yield
    mp.undo()


@pytest.mark.parametrize(
    ("fn", "args"), CASES, ids=[f"{fn.__name__}{list(a[0]) if a else ''}" for fn, a in CASES]
)
def test_eager_case_in_process_mode(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    from torch_dtorch.device.state import get_session

    fn(*args)
    assert get_session().mode == "process"
