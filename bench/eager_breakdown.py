"""Where the eager controller's time goes: each layer timed in isolation (16×16 ``add``, 1-device CPU mesh, workers
held back so no worker thread competes for the GIL). Complements ``bench/eager_overhead.py``.

    .venv/bin/python bench/eager_breakdown.py [--iters 5000]
"""

from __future__ import annotations

import argparse
import timeit

import torch

import torch_dtorch as dt
from torch_dtorch import Replicate
from torch_dtorch.device import dispatch
from torch_dtorch.device.state import get_session
from torch_dtorch.device.tensors import TABLE
from torch_dtorch.placement_rules import OpCall, get_rule

aten = torch.ops.aten


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=5000)
    n = p.parse_args().iters
    torch.set_num_threads(1)
    mesh = dt.init_device_mesh("cpu", (1,))
    a = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
    b = dt.distribute_tensor(torch.randn(16, 16), mesh, [Replicate()])
    rt = get_session()
    ex = rt.executor
    dt.sync()
    ex.batch_size, ex.flush_interval = 10**9, 3600.0  # hold the workers back while timing
    oa, ob = dispatch.operand_of(a), dispatch.operand_of(b)
    rule = get_rule(aten.add.Tensor)
    rows = [
        ("a + b on dtorch tensors (everything)", lambda: a + b),
        ("dispatch.dispatch called directly", lambda: dispatch.dispatch_op(aten.add.Tensor, (a, b), {})),
        ("EagerGraphExecutor.call on operands", lambda: ex.call(aten.add.Tensor, oa, ob)),
        ("GraphConstructor.call on operands", lambda: ex.constructor.call(aten.add.Tensor, oa, ob)),
        ("OpCall.make + cached OpRule.plan", lambda: rule.plan(OpCall.make(aten.add.Tensor, (oa, ob), {}))),
        ("wrap output (+ free of the previous one)", lambda: dispatch.wrap(rt, oa)),
        (
            "two tensor->operand lookups",
            lambda: (TABLE.lookup(a, rt.generation), TABLE.lookup(b, rt.generation)),
        ),
    ]
    print("| layer | µs/op |")
    print("|---|---|")
    for name, fn in rows:
        fn()
        print(f"| {name} | {timeit.timeit(fn, number=n) / n * 1e6:.0f} |")
    dt.shutdown()


if __name__ == "__main__":
    main()
