"""The sticky-error protocol (runtime/sticky.py) step by step, as both OpRunner and compiled programs use it."""

from __future__ import annotations

import pytest

from torch_dtorch.runtime.blob import Blob, KernelError
from torch_dtorch.runtime.sticky import PoisonBoard, StickyCall, call_hooks, kernel_error


def test_first_error_wins_and_poisons_every_output() -> None:
    blobs: dict[int, Blob] = {}
    call = StickyCall(board=None, key=7)
    assert not call.poison(blobs, [7, 8]) and not blobs
    first = KernelError("aten.mm", 0, "first")
    call.fail(first)
    call.fail(KernelError("aten.mm", 0, "second"))
    assert call.poison(blobs, [7, 8])
    assert blobs[7].error is first and blobs[8].error is first


def test_a_poisoned_rank_posts_once_before_communicating_and_its_peer_joins() -> None:
    board = PoisonBoard()
    bad, good = StickyCall(board=board, key=3), StickyCall(board=board, key=3)
    err = KernelError("aten.all_gather", 1, "input poisoned")
    bad.fail(err)
    good.before_comm()  # a healthy rank posts nothing
    assert board.get(3) is None
    bad.before_comm()
    bad.before_comm()
    assert bad.posted and board.get(3) is err
    good.after_comm()  # after the collective: the peer that received zeros takes the error
    assert good.error is err
    other = StickyCall(board=board, key=4)
    other.after_comm()  # another call's key is untouched
    assert other.error is None


def test_no_board_or_no_key_is_a_single_rank() -> None:
    call = StickyCall(board=None, key=None)
    call.fail(KernelError("aten.add", 0, "x"))
    call.before_comm()
    call.after_comm()
    assert not call.posted and call.error is not None


def test_kernel_error_wraps_with_cause_and_keeps_kernel_errors() -> None:
    e = ValueError("bad shape")
    wrapped = kernel_error(e, op="aten.view", device=2, call_site="model.py:3", detail="in segment 0")
    assert isinstance(wrapped, KernelError) and wrapped.__cause__ is e and "aten.view" in str(wrapped)
    same = KernelError("aten.view", 2, "x")
    assert kernel_error(same, op="other", device=0) is same


def test_a_broken_hook_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[tuple[object, int]] = []

    def broken(instr: object, device: int) -> None:
        raise RuntimeError("hook bug")

    call_hooks([broken, lambda i, d: seen.append((i, d))], "instr", 1)
    assert seen == [("instr", 1)] and "hook bug" in caplog.text
