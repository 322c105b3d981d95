"""Both runners satisfy the executor's ``Runner`` protocol (the session holds one of either)."""

from __future__ import annotations

from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.executor.runner import Runner
from torch_dtorch.executor.thread_runner import ThreadRunner


def test_thread_runner_is_a_runner() -> None:
    runner = ThreadRunner([0, 1])
    try:
        assert isinstance(runner, Runner)
        assert runner.devices == (0, 1) and runner.device_type == "cpu" and not runner.closed
        assert runner.wait_idle(1.0)
    finally:
        runner.shutdown()
    assert runner.closed


def test_cluster_runner_has_every_member_of_the_protocol() -> None:
    # (starting worker processes is tests/cluster's business; mypy checks the types where the session makes one)
    for name in ("submit", "wait_idle", "shutdown", "closed"):
        assert hasattr(ClusterRunner, name), name
