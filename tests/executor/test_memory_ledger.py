"""The memory check's ledger (torch_dtorch/executor/memory_ledger.py): every counted byte goes exactly once --
when its operand dies, when the batch it was submitted in ran (live figures), when its pool's figure is new."""

from __future__ import annotations

from torch_dtorch.executor.memory_ledger import PlannedLedger


def _hit(ledger: PlannedLedger, oid: int, n: int, pool: int = 0) -> None:
    ledger.add([(pool, n)])  # (the fast path adds inline, then ties the bytes to the output)
    ledger.track_hit(oid, ((pool, n),))


def test_a_hit_output_that_dies_takes_its_bytes() -> None:
    ledger = PlannedLedger([True])
    _hit(ledger, 1, 100)
    _hit(ledger, 2, 50)
    ledger.released([1])
    assert ledger.planned == [50]
    ledger.released([1, 3])  # dead twice, or never counted: nothing more
    assert ledger.planned == [50]


def test_a_finished_batch_takes_what_was_counted_before_it_once() -> None:
    ledger = PlannedLedger([True])
    _hit(ledger, 1, 100)
    ledger.add([(0, 30)])
    ledger.track(10, ((0, 30),))  # a checked upload
    ledger.mark(1)
    _hit(ledger, 2, 50)
    ledger.forget_finished(1)
    assert ledger.planned == [50]
    ledger.released([1, 10])  # forgotten with the batch: not lowered again
    assert ledger.planned == [50]
    ledger.released([2])
    assert ledger.planned == [0]
    assert not ledger.tracking


def test_a_checked_operand_counted_before_a_mark_lowers_it_when_it_dies() -> None:
    ledger = PlannedLedger([True])
    ledger.add([(0, 30)])
    ledger.track(10, ((0, 30),))
    ledger.mark(1)
    ledger.add([(0, 20)])
    ledger.track(11, ((0, 20),))
    ledger.released([10])  # the mark counted it: lowered, so forgetting the mark does not subtract it again
    assert ledger.planned == [20]
    ledger.forget_finished(1)
    assert ledger.planned == [20]


def test_an_in_place_hit_adds_to_what_its_written_input_holds() -> None:
    ledger = PlannedLedger([True])
    _hit(ledger, 5, 10)
    _hit(ledger, 5, 7)
    ledger.released([5])
    assert ledger.planned == [0]


def test_a_new_report_forgets_one_pool_only() -> None:
    ledger = PlannedLedger([False, False])
    _hit(ledger, 1, 100, pool=0)
    _hit(ledger, 2, 40, pool=1)
    ledger.forget_pool(0)
    assert ledger.planned == [0, 40]
    ledger.released([1])  # its pool's figure showed it already
    assert ledger.planned == [0, 40]
    ledger.released([2])
    assert ledger.planned == [0, 0]
