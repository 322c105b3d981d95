"""Placing a model on a mesh freezes the start-up heap out of the garbage collector, once per process
(``DTORCH_GC_FREEZE``; torch_dtorch/device/heap.py): a full collection of a FLUX pipeline's heap took 329 ms on an
H100 host and stalled the worker thread as long. Each case runs in a fresh interpreter (the freeze is per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import gc, json, torch
    import torch_dtorch as dt
    from torch_dtorch.nn import replicate_module
    mesh = dt.init_device_mesh("cpu", (2,))
    before = gc.get_freeze_count()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    ref = model(torch.ones(3, 8))
    replicate_module(model, mesh)
    first = gc.get_freeze_count()
    keep = [[] for _ in range(5000)]  # tracked objects a second freeze would take
    replicate_module(torch.nn.Linear(4, 4), mesh)  # a second model: no second freeze
    second = gc.get_freeze_count()
    out = dt.to_torch(model(dt.distribute_tensor(torch.ones(3, 8), mesh)))
    print(json.dumps({"before": before, "first": first, "second": second, "equal": bool(torch.equal(out, ref))}))
    """
)


def _run(env_value: str | None) -> dict[str, int | bool]:
    import json

    env = dict(os.environ)
    env.pop("DTORCH_GC_FREEZE", None)
    if env_value is not None:
        env["DTORCH_GC_FREEZE"] = env_value
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_placing_a_model_freezes_the_heap_once() -> None:
    r = _run(None)
    assert r["before"] == 0
    assert r["first"] > 1000  # torch, the model, the mesh: everything alive then
    assert r["second"] <= r["first"]  # (frozen objects freed by reference counting leave the count)
    assert r["equal"]


@pytest.mark.slow
def test_the_freeze_can_be_turned_off() -> None:
    r = _run("0")
    assert r["before"] == r["first"] == r["second"] == 0
    assert r["equal"]
