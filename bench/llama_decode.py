"""Decode steps at lengths never planned before: a growing KV-cache ``cat``, and HF ``generate`` on a tiny Llama.

Benchmarks that repeat one ``generate`` call reuse the plans their warm-up made for every length; a long generation
meets a new cache length every token. This measures that case (CPU, thread mode, one intra-op thread):

- ``cat``: a ``[2, 2, L, 16]`` cache grows by ``torch.cat([past, new], dim=-2)``, ``--cats`` times per run, each run
  from a start length no earlier run reached; µs per cat, end to end (the result fetched), median of ``--runs``;
- ``generate``: per run (``--runs``) a batch-2 prompt of a length no earlier run reached; greedy ``generate`` of
  ``--tokens`` tokens minus the prefill (``generate`` of 1 token, timed after a first call planned it), per decoded
  token — at new lengths, then the same call again (lengths planned) — with the calls planned in full (fast-path
  misses, ``GraphConstructor.num_planned``), the templates derived from a kept decision instead
  (``device/fastpath_grow.py``), the shape inferences (plan-cache misses) and worker fetches per new-length token
  (the prefill's included, spread over the tokens), medians.

    PYTHONPATH=$PWD python bench/llama_decode.py                 # 1-device mesh
    PYTHONPATH=$PWD python bench/llama_decode.py --mesh tp=2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch


def _mesh(spec: str) -> Any:
    import torch_dtorch as dt

    axes = {k: int(v) for k, v in (a.split("=") for a in spec.split(",") if a)}
    return dt.init_device_mesh("cpu", tuple(axes.values()) or (1,), mesh_dim_names=tuple(axes) or ("dp",))


def bench_cat(mesh: Any, cats: int, runs: int) -> float:
    import torch_dtorch as dt
    from torch_dtorch import Replicate, Shard

    names = mesh.mesh_dim_names or ()
    pl = [Shard(1) if n == "tp" else Shard(0) if n == "dp" else Replicate() for n in names]
    new = dt.distribute_tensor(torch.randn(2, 2, 1, 16), mesh, pl)
    start = [8]

    def run(n: int) -> float:
        past = dt.distribute_tensor(torch.randn(2, 2, start[0], 16), mesh, pl)
        start[0] += n + 1
        t0 = time.perf_counter()
        for _ in range(n):
            past = torch.cat([past, new], dim=-2)
        dt.to_torch(past)
        return (time.perf_counter() - t0) / n * 1e6

    run(20)
    return statistics.median(run(cats) for _ in range(runs))


def bench_generate(mesh: Any, tokens: int, runs: int) -> dict[str, float]:
    """Per run a prompt length no earlier run reached: ``generate(1)`` twice (the prefill planned), then
    ``generate(1 + tokens)``, whose decode steps all meet new lengths; then the same again (all planned)."""
    import torch_dtorch as dt
    from torch_dtorch.apps.llama import parallelize_llama
    from torch_dtorch.apps.llama.tiny import TinyLlama, tiny_llama
    from torch_dtorch.device import fastpath_grow
    from torch_dtorch.device.state import get_session
    from torch_dtorch.placement_rules import rule as rule_mod

    sizes = TinyLlama(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    model = parallelize_llama(tiny_llama(sizes, seed=0), mesh)
    counts = {"infer": 0, "fetch": 0}

    def gen(ids: torch.Tensor, n: int) -> float:
        t0 = time.perf_counter()
        out = model.generate(
            ids.to("dtorch"),
            attention_mask=torch.ones_like(ids).to("dtorch"),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        dt.to_torch(out)
        return time.perf_counter() - t0

    def prompt(length: int) -> torch.Tensor:
        return torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(length))

    gen(prompt(4), tokens)  # warm: pools, the first plans
    infer = rule_mod.OpRule.infer_meta
    executor = type(get_session().executor)
    fetch = executor.fetch

    def counting_infer(self: Any, call: Any) -> Any:
        counts["infer"] += 1
        return infer(self, call)

    def counting_fetch(self: Any, operand: Any) -> Any:
        counts["fetch"] += 1
        return fetch(self, operand)

    rule_mod.OpRule.infer_meta = counting_infer  # type: ignore[method-assign]
    executor.fetch = counting_fetch  # type: ignore[method-assign]
    new, seen, infers, fetches, plans, derived = [], [], [], [], [], []
    constructor = get_session().executor.constructor
    try:
        length = 8 + tokens
        for _ in range(runs):
            ids = prompt(length)
            length += tokens + 2
            gen(ids, 1)
            prefill = gen(ids, 1)
            counts.update(infer=0, fetch=0)
            planned, grown = constructor.num_planned, fastpath_grow.stats["derived"]
            whole = gen(ids, 1 + tokens)
            plans.append((constructor.num_planned - planned) / tokens)
            derived.append((fastpath_grow.stats["derived"] - grown) / tokens)
            infers.append(counts["infer"] / tokens)
            fetches.append(counts["fetch"] / tokens)
            new.append((whole - prefill) / tokens)
            seen.append((gen(ids, 1 + tokens) - prefill) / tokens)
    finally:
        rule_mod.OpRule.infer_meta = infer  # type: ignore[method-assign]
        executor.fetch = fetch  # type: ignore[method-assign]
    return {
        "new_ms_per_token": statistics.median(new) * 1e3,
        "seen_ms_per_token": statistics.median(seen) * 1e3,
        "new_shape_inferences_per_token": statistics.median(infers),
        "fetches_per_token": statistics.median(fetches),
        "full_plans_per_token": statistics.median(plans),
        "derived_templates_per_token": statistics.median(derived),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mesh", default="", help="axes, e.g. tp=2 (default: 1 device)")
    p.add_argument("--cats", type=int, default=200)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--skip-generate", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    mesh = _mesh(args.mesh)
    print(
        f"mesh {args.mesh or 'dp=1'}: growing cat at new lengths {bench_cat(mesh, args.cats, args.runs):.0f} us/cat"
    )
    if not args.skip_generate:
        r = bench_generate(mesh, args.tokens, args.runs)
        print(
            f"generate: {r['new_ms_per_token']:.2f} ms/token at new lengths, {r['seen_ms_per_token']:.2f} at planned"
            f" ones; {r['full_plans_per_token']:.1f} full plans,"
            f" {r['derived_templates_per_token']:.1f} derived templates,"
            f" {r['new_shape_inferences_per_token']:.1f} shape inferences and"
            f" {r['fetches_per_token']:.2f} fetches per new-length token"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
