"""Op coverage of dtorch next to upstream DTensor, on the same OpInfo samples and placements at world size 4.

    python bench/op_coverage.py [--limit N] [--only KEY ...] [--out bench/op_coverage.md]

For every float32 OpInfo (first sample, as in ``tests/conformance``), each placement config — all-Replicate, then
``Shard(d)`` of the sample input (and every tensor of its shape) for each dim ``d`` — runs

- through **dtorch** on a 4-device mesh (worker threads; ``tests/conformance/harness.py`` classifies the case), and
- through **upstream DTensor** on a 4-rank ``DeviceMesh("cpu")`` of the in-process threaded process group
  (``torch.testing._internal.distributed.multi_threaded_pg``), ``full_tensor()`` compared with torch.

Statuses per op (worst case first): ``wrong`` (a value differing from torch), ``error``, ``no rule`` (dtorch's
``NoRuleError``; DTensor's "no sharding strategy"), then a pass, split the same way for both: ``fallback`` (some
case gathered a sharded input: dtorch recorded an ``S -> R`` redistribute, DTensor issued an ``all_gather`` while
running the op, counted with ``CommDebugMode``; or the op had no shardable input) and ``sharded``.
Random OpInfos draw from one process-wide generator that DTensor's four rank threads share, so their DTensor
values are not comparable (reported as they come out).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, DTensor, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conformance import harness  # noqa: E402

WORLD = 4
_ORDER = ("wrong", "error", "no rule", "fallback", "sharded", "skipped")
_PASSED = ("sharded", "fallback")


def _dtensor_case(fn: Any, sample: Any, shard_dim: int | None, want: Any, values: bool) -> tuple[str, str]:
    mesh = DeviceMesh("cpu", list(range(WORLD)))
    primary = harness._primary(sample)

    def conv(t: torch.Tensor) -> torch.Tensor:
        return distribute_tensor(
            t.detach().clone(), mesh, harness._placements_for(t, shard_dim, primary, mesh)
        )

    try:
        inp, args, kwargs = pytree.tree_map_only(
            torch.Tensor, conv, (sample.input, sample.args, sample.kwargs)
        )
        torch.manual_seed(0)
        with CommDebugMode() as comms:
            out = fn(inp, *args, **kwargs)
        got = pytree.tree_map_only(DTensor, lambda d: d.full_tensor(), out)
        gathered = any("all_gather" in str(op) for op in comms.get_comm_counts())
    except Exception as e:  # noqa: BLE001 - every failure is classified
        text = str(e).strip().splitlines()
        first = f"{type(e).__name__}: {text[0] if text else ''}"[:200]
        if "sharding strategy" in str(e) or "sharding propagation" in str(e).lower():
            return "no rule", first
        return "error", first
    if not values:
        got, want = harness._shapes(got), harness._shapes(want)
    diff = harness._compare(got, want, exact=False)
    if diff:
        return "wrong", diff[:200]
    return ("fallback" if gathered else "sharded"), ""


def _run_dtensor(info: Any, cases: list[tuple[Any, str, int | None, Any]]) -> list[tuple[str, str]]:
    """Each case of one OpInfo in its own 4-rank threaded world; the worst (status, detail) over the ranks."""
    return [_run_world(info, case) for case in cases]


def _run_world(info: Any, case: tuple[Any, str, int | None, Any]) -> tuple[str, str]:
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, _install_threaded_pg

    sample, _, shard_dim, want = case
    values = info.name not in harness.UNINITIALIZED
    world = _install_threaded_pg()
    store = dist.HashStore()
    results: list[tuple[str, str]] = [("error", "rank did not finish")] * WORLD

    def rank_main(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=WORLD, store=store)
        try:
            results[rank] = _dtensor_case(info.op, sample, shard_dim, want, values)
            if results[rank][0] in ("error", "no rule"):
                # the other ranks may wait in a collective this rank never joins: wake them
                ProcessLocalGroup.exception_handle(RuntimeError(results[rank][1]))
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # type: ignore[attr-defined]
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(WORLD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        if any(t.is_alive() for t in threads):
            ProcessLocalGroup.exception_handle(RuntimeError("timeout"))
            return "error", "DTensor ranks did not finish within 60 s (diverging collectives)"
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)  # type: ignore[attr-defined]
        ProcessLocalGroup.reset()
    real = [r for r in results if r[1] != "rank did not finish"] or results
    return min(real, key=lambda r: _ORDER.index(r[0]))


def _worst(statuses: list[str], shardable: bool) -> str:
    """The worst case; a pass of an op with no shardable input (only the all-Replicate case) is a fallback."""
    worst = min(statuses, key=_ORDER.index) if statuses else "skipped"
    return "fallback" if worst == "sharded" and not shardable else worst


def run(keys: list[str] | None, limit: int | None) -> list[tuple[str, str, str, str]]:
    """Rows ``(op, dtorch status, DTensor status, first differing detail)``."""
    import torch_dtorch as dt

    infos = harness.conformance_opinfos()
    if keys:
        infos = [i for i in infos if harness.op_key(i) in keys]
    infos = infos[:limit] if limit else infos
    mesh = dt.init_device_mesh("cpu", (WORLD,))
    rows = []
    for info in infos:
        samples = harness.samples_for(info, 1)
        cases = []
        for sample in samples:
            try:
                want = harness._reference(info.op, sample)
            except Exception:  # noqa: BLE001 - torch rejects the sample: both sides skip it
                continue
            cases += [(sample, name, d, want) for name, d in harness.placement_configs(sample, (WORLD,))]
        if not cases:
            rows.append((harness.op_key(info), "skipped", "skipped", ""))
            continue
        ours = []
        values = info.name not in harness.UNINITIALIZED
        for sample, _, d, want in cases:
            status, detail = harness.run_case(info.op, sample, mesh, d, want, values=values)
            ours.append((status.value, detail))
        theirs = _run_dtensor(info, cases)
        detail = next((d for s, d in ours if s not in _PASSED), "") or next(
            (d for s, d in theirs if s not in _PASSED), ""
        )
        shardable = any(d is not None for _, _, d, _ in cases)
        rows.append(
            (
                harness.op_key(info),
                _worst([s for s, _ in ours], shardable),
                _worst([s for s, _ in theirs], shardable),
                detail,
            )
        )
    dt.shutdown()
    return rows


def render(rows: list[tuple[str, str, str, str]], seconds: float) -> str:
    ours = collections.Counter(r[1] for r in rows)
    theirs = collections.Counter(r[2] for r in rows)
    passed = _PASSED
    lines = [
        "# Op coverage: dtorch and upstream DTensor",
        "",
        f"Generated by `python bench/op_coverage.py` (torch {torch.__version__}, {len(rows)} OpInfos, first float32",
        f"sample, all-Replicate and every `Shard(d)` of the sample input, world size {WORLD}; {seconds:.0f} s).",
        "",
        "| status | dtorch | DTensor |",
        "|---|---:|---:|",
    ]
    for s in _ORDER:
        if ours[s] or theirs[s]:
            lines.append(f"| {s} | {ours[s]} | {theirs[s]} |")
    n_ours = sum(ours[s] for s in passed)
    n_theirs = sum(theirs[s] for s in passed)
    lines += [f"| **passes** | **{n_ours}** | **{n_theirs}** |", "", "## Where they differ", ""]
    lines += ["| OpInfo | dtorch | DTensor | first failure |", "|---|---|---|---|"]
    for op, a, b, detail in rows:
        if (a in passed) != (b in passed) or "wrong" in (a, b):
            lines.append(f"| `{op}` | {a} | {b} | {detail.replace('|', '/')[:140]} |")
    behind = sorted(op for op, a, b, _ in rows if a == "fallback" and b == "sharded")
    ahead = sum(1 for _, a, b, _ in rows if a == "sharded" and b != "sharded")
    lines += [
        "",
        f"dtorch keeps {ahead} OpInfo(s) sharded that DTensor does not; DTensor keeps {len(behind)} sharded that dtorch",
        "passes only by gathering" + (": " + ", ".join(f"`{op}`" for op in behind) if behind else "") + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="only the first N OpInfos")
    parser.add_argument("--only", nargs="*", default=None, help="OpInfo keys to run")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    a = parser.parse_args()
    t0 = time.perf_counter()
    rows = run(a.only, a.limit)
    text = render(rows, time.perf_counter() - t0)
    if a.out:
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
