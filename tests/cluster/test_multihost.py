"""Multi-host set-up, simulated on one machine: workers started with ``dtorch worker`` join a controller over TCP
from distinct addresses (loopback aliases 127.0.0.2/3, or network namespaces joined by veth pairs); a worker with
the wrong secret is refused."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torch_dtorch as dt
from torch_dtorch import Replicate, Shard
from torch_dtorch.cluster.protocol import ClusterConfig, write_secret_file
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.device.state import get_session

pytestmark = pytest.mark.slow


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# Start-up budgets: a remote worker imports torch twice (`dtorch worker`, then its worker process) while the
# controller waits; on a loaded 2-core CI box that alone has taken over a minute.
START_TIMEOUT_S = 180.0


def worker_cmd(
    controller: str, secret: Path, devices: str, host: str, timeout: float = START_TIMEOUT_S
) -> list[str]:
    return [sys.executable, "-m", "torch_dtorch.cli", "worker", "--controller", controller, "--secret-file",
            str(secret), "--devices", devices, "--host", host, "--start-timeout", str(timeout)]  # fmt: skip


def run_cluster(controller_host: str, procs: list[subprocess.Popen[str]], secret: Path) -> ClusterRunner:
    port_endpoint = procs[0].args[5]  # type: ignore[index]
    cfg = ClusterConfig(
        listen=port_endpoint, secret_file=str(secret), local_devices=(), start_timeout_s=START_TIMEOUT_S
    )
    mesh = dt.init_device_mesh("cpu", (2,), mode="process", cluster=cfg)
    x = torch.randn(6, 5)
    d = dt.distribute_tensor(x, mesh, [Shard(0)])
    torch.testing.assert_close((d * 2).redistribute(mesh, [Replicate()]).full_tensor(), x * 2)
    runner = get_session().executor.runner
    assert isinstance(runner, ClusterRunner)
    return runner


def finish(procs: list[subprocess.Popen[str]]) -> None:
    dt.shutdown()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def test_workers_on_loopback_addresses_and_a_wrong_secret(tmp_path: Path) -> None:
    secret, wrong = tmp_path / "secret", tmp_path / "wrong"
    write_secret_file(str(secret))
    write_secret_file(str(wrong))
    endpoint = f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
    bad = subprocess.Popen(
        worker_cmd(endpoint, wrong, "1", "127.0.0.4", timeout=4), stderr=subprocess.PIPE, text=True
    )
    procs = [
        subprocess.Popen(worker_cmd(endpoint, secret, str(d), f"127.0.0.{d + 2}"), text=True) for d in (0, 1)
    ]
    try:
        runner = run_cluster("127.0.0.1", procs, secret)
        assert {m.peer for m in runner.members.values()} == {"127.0.0.2", "127.0.0.3"}
        assert {m.host for m in runner.members.values()} == {"127.0.0.2", "127.0.0.3"}
        _, err = bad.communicate(timeout=60)
        assert bad.returncode != 0 and "no WELCOME" in err, err
        refused = [r for r in runner.rejected if "refused" in r]
        assert refused and "signature does not match" in refused[0] and "127.0.0.4" in refused[0], (
            runner.rejected
        )
        finish(procs)
        assert [p.returncode for p in procs] == [0, 0]
    finally:
        for p in [bad, *procs]:
            if p.poll() is None:
                p.kill()


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def netns() -> Iterator[tuple[str, str]]:
    """A network namespace ``dtorch-h1`` (a second "host", 10.77.91.2) joined to this one (10.77.91.1) by a veth
    pair; skipped with the reason if the kernel or the permissions refuse."""
    ns, here, there = "dtorch-h1", "dtorch-veth0", "dtorch-veth1"
    try:
        _sh("ip", "netns", "add", ns)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot create a network namespace here: {getattr(e, 'stderr', e)}")
    try:
        _sh("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _sh("ip", "link", "set", there, "netns", ns)
        _sh("ip", "addr", "add", "10.77.91.1/24", "dev", here)
        _sh("ip", "link", "set", here, "up")
        _sh("ip", "netns", "exec", ns, "ip", "addr", "add", "10.77.91.2/24", "dev", there)
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", there, "up")
        _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, "10.77.91.1"
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot wire a veth pair into the namespace: {e.stderr}")
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_workers_in_a_network_namespace(tmp_path: Path, netns: tuple[str, str]) -> None:
    ns, controller_ip = netns
    secret = tmp_path / "secret"
    write_secret_file(str(secret))
    endpoint = f"tcp://{controller_ip}:{free_port(controller_ip)}"
    cmd = ["ip", "netns", "exec", ns, *worker_cmd(endpoint, secret, "0,1", "10.77.91.2")]
    procs = [subprocess.Popen(cmd, text=True)]
    procs[0].args = cmd[4:]  # for run_cluster: the endpoint at the same index as for a plain worker
    try:
        t0 = time.monotonic()
        runner = run_cluster(controller_ip, procs, secret)
        assert {m.peer for m in runner.members.values()} == {"10.77.91.2"}, time.monotonic() - t0
        finish(procs)
        assert procs[0].returncode == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
