"""The memory pools a :class:`~torch_dtorch.cluster.runner.ClusterRunner` shows the controller's memory pre-check
(:mod:`torch_dtorch.executor.memory_check`, through the runner's ``memory_pools()``): local CPU workers share this
host's RAM (read here, live); remote CPU workers their host's RAM, and CUDA workers their GPU's memory, as each worker
last reported it (when ready and with every value it sends: ``Member.mem_free``, counted in ``Member.mem_reports``,
which the pre-check's ledger uses to forget the bytes a report already shows)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch_dtorch.cluster.joins import Member
from torch_dtorch.executor.memory_check import MemoryPool, host_available_bytes

__all__ = ["memory_pools"]


def memory_pools(members: Iterable[Member], *, device_type: str) -> list[MemoryPool]:
    """One pool per memory the workers of ``members`` share (see the module docstring)."""
    pools: list[MemoryPool] = []
    groups: dict[tuple[str, int | None], list[Member]] = {}
    for m in members:
        if device_type == "cpu" and m.local:
            groups.setdefault(("", None), []).append(m)
        else:
            groups.setdefault((m.host, m.cuda_index if device_type == "cuda" else None), []).append(m)
    for (host, index), ms in groups.items():
        devices = tuple(m.device for m in ms)
        if device_type == "cpu" and not host and index is None and all(m.local for m in ms):
            pools.append(MemoryPool("host RAM", devices, host_available_bytes))
            continue
        name = f"cuda:{index} of host {host!r}" if device_type == "cuda" else f"RAM of host {host!r}"
        pools.append(MemoryPool(name, devices, _reported_free(ms), _report_count(ms)))
    return pools


def _report_count(ms: list[Member]) -> Callable[[], int]:
    return lambda: sum(m.mem_reports for m in ms)


def _reported_free(ms: list[Member]) -> Callable[[], int | None]:
    def free() -> int | None:
        figures = [m.mem_free for m in ms if m.mem_free is not None]
        return min(figures) if figures else None

    return free
