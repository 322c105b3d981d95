"""Imported by cluster-mode workers in tests (``DTORCH_WORKER_IMPORTS=tests.cluster.worker_hooks``).

- ``DTORCH_TEST_SLOW_OP=aten.cos:1:3.0``: device 1 sleeps 3 s before every ``aten.cos`` (a long kernel);
  ``DTORCH_TEST_SLOW_AFTER=n``: only after its first ``n`` calls (fast-path hits come later);
- ``DTORCH_TEST_FAIL_OP=aten.sigmoid:2``: ``aten.sigmoid`` raises on device 2 (a planted kernel failure);
- ``DTORCH_TEST_GENERAL_LIMIT=aten.mul.Tensor:2``: a worker raises once it ran ``aten.mul.Tensor`` on its general
  local path more than twice (replayed fast-path hits do not count: a test of the replay in process mode);
- ``DTORCH_TEST_PY_ADD_LIMIT=n``: a worker raises once ops were queued on its native chain through Python
  (``NativeChain.add``) more than ``n`` times (hit records the C++ lane queues do not count).
"""

from __future__ import annotations

import os
import time
from typing import Any

from torch_dtorch.runtime import op_runner as kernel_mod


def _parse(var: str) -> list[str] | None:
    raw = os.environ.get(var, "").strip()
    return raw.split(":") if raw else None


_SLOW = _parse("DTORCH_TEST_SLOW_OP")
_FAIL = _parse("DTORCH_TEST_FAIL_OP")


def _name(instr: Any) -> str:
    node = getattr(instr, "node", instr)
    return str(getattr(node, "name", ""))


_SLOW_AFTER = int(os.environ.get("DTORCH_TEST_SLOW_AFTER", "0") or 0)
_calls = 0


def _before(instr: Any, device: int) -> None:
    global _calls
    name = _name(instr)
    if _SLOW is not None and name == _SLOW[0] and device == int(_SLOW[1]):
        _calls += 1
        if _calls > _SLOW_AFTER:
            time.sleep(float(_SLOW[2]))


if _SLOW is not None:
    kernel_mod.before_hooks.append(_before)

if _FAIL is not None:
    import torch

    from torch_dtorch.placement_rules import get_rule

    _op, _device = _FAIL[0], int(_FAIL[1])
    _overload = getattr(torch.ops.aten, _op.split(".")[1]).default
    _rule = get_rule(_overload)  # may be shared by a whole op family: only the named op fails
    _kernel = _rule._kernel

    def _broken(call: Any, ctx: Any, args: Any, kwargs: Any) -> Any:
        if ctx.device == _device and call.op == _overload:
            raise RuntimeError("planted failure")
        if _kernel is not None:
            return _kernel(call, ctx, args, kwargs)
        return call.op(*args, **kwargs)

    _rule._kernel = _broken  # type: ignore[method-assign]

_GENERAL = _parse("DTORCH_TEST_GENERAL_LIMIT")

if _GENERAL is not None:
    _general_op, _limit = _GENERAL[0], int(_GENERAL[1])
    _run_op = kernel_mod.OpRunner.run_op
    _general_calls = 0

    def _counted(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        global _general_calls
        if node.name == _general_op:
            _general_calls += 1
            if _general_calls > _limit:
                raise RuntimeError(
                    f"{_general_op} took the general path {_general_calls} times (limit {_limit})"
                )
        return _run_op(self, node, *args, **kwargs)

    kernel_mod.OpRunner.run_op = _counted  # type: ignore[method-assign]

_PY_ADD = _parse("DTORCH_TEST_PY_ADD_LIMIT")

if _PY_ADD is not None:
    from torch_dtorch.runtime.native_replay import NativeChain

    _add_limit = int(_PY_ADD[0])
    _add = NativeChain.add
    _py_adds = 0

    def _counted_add(self: Any, *args: Any, **kwargs: Any) -> bool:
        global _py_adds
        _py_adds += 1
        if _py_adds > _add_limit:
            raise RuntimeError(
                f"{_py_adds} ops queued on the native chain through Python (limit {_add_limit})"
            )
        return bool(_add(self, *args, **kwargs))

    NativeChain.add = _counted_add  # type: ignore[method-assign]
