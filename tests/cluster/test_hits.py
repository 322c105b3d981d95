"""The codec's binary hit records (``cluster/codec/hits.py``): round trip, size, malformed and truncated frames (a
``CodecError`` naming the batch, never a crash or a hang; through a real cluster a ``WorkerFailedError`` naming the
worker), and the heartbeat naming a record's op while it runs."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torch_dtorch as dt
from tests.cluster.conftest import wait_gone
from tests.cluster.transport.test_codec import same_instr
from torch_dtorch import Replicate, Shard
from torch_dtorch.cluster.codec import VERSION, BatchDecoder, BatchEncoder, CodecError, hits
from torch_dtorch.cluster.codec.common import MAGIC
from torch_dtorch.cluster.heartbeat import WorkerHangError
from torch_dtorch.cluster.protocol import WorkerFailedError
from torch_dtorch.cluster.runner import ClusterRunner
from torch_dtorch.cluster.transport import MessageKind, wire
from torch_dtorch.config import get_config
from torch_dtorch.device.state import get_session
from torch_dtorch.executor.instructions import FastRun, Free, Instruction, RunOp

SECRET = b"k" * 32


def capture(steps: int = 200, shape: tuple[int, ...] = (2,)) -> list[list[Instruction]]:
    """The batches a thread-mode session submits for a chain of fast-path hits (with ``x + x`` and a view)."""
    mesh = dt.init_device_mesh("cpu", shape, mode="thread")
    runner = get_session().executor.runner
    batches: list[list[Instruction]] = []
    submit = runner.submit

    def record(batch: Any) -> None:
        batches.append(list(batch))
        submit(batch)

    runner.submit = record  # type: ignore[method-assign]
    try:
        x = dt.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        b = dt.distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
        for i in range(steps):
            x = torch.sigmoid(x * 0.5 + b)
            if i % 7 == 0:
                x = x + x
            if i % 11 == 0:
                x = x.t().t()
        dt.sync()
    finally:
        dt.shutdown()
    return batches


@pytest.fixture(scope="module")
def batches() -> list[list[Instruction]]:
    return capture()


def through_wire(enc: BatchEncoder, dec: BatchDecoder, batch: list[Instruction]) -> list[Any]:
    frames = wire.encode(enc.encode(batch), kind=MessageKind.BATCH, seq=1, sender="controller", secret=SECRET)
    return dec.decode(wire.decode(frames, secret=SECRET).body)


def expand(dec: BatchDecoder, instrs: list[Any]) -> Iterator[Any]:
    """Decoded instructions with every hit run turned back into its RunOps and Frees."""
    for instr in instrs:
        if type(instr) is not hits.HitRun:
            yield instr
            continue
        w, p = instr.words, instr.start
        while p < instr.end:
            if w[p] & 3 == hits.FREE:
                n = w[p] >> 2
                yield Free(w[p + 1 : p + 1 + n])
                p += 1 + n
                continue
            ht = dec._tables["hit"][w[p] >> 2]
            q = p + 3 + ht.n_slots
            yield dec.materialize(ht, w[p + 1], w[p + 3 : q], w[p + 2])
            p = q


def test_records_decode_to_the_same_instructions_as_json(batches: list[list[Instruction]]) -> None:
    n_fast = sum(type(i) is FastRun for b in batches for i in b)
    assert n_fast > 300
    enc, dec = BatchEncoder(hits=True), BatchDecoder()
    ref_enc, ref_dec = BatchEncoder(hits=False), BatchDecoder()
    words = 0
    for batch in batches:
        got = list(expand(dec, through_wire(enc, dec, batch)))
        want = ref_dec.decode(ref_enc.encode(batch))
        words += len(dec._words)
        assert [type(i) for i in got] == [type(i) for i in want]
        for a, b in zip(want, got, strict=True):
            same_instr(a, b, views=False)  # a record's view outputs are plain operands on the worker
            if type(a) is RunOp:
                assert b.replay_key is not None or a.replay_key is None
    assert words > 5 * n_fast // 2, "most hits should travel as records"


def test_the_native_lane_encodes_what_the_python_encoder_does(batches: list[list[Instruction]]) -> None:
    """The C++ encoding lane (``_replay.cpp``'s ``encode_hits``) writes the same records, JSON and tables as the
    Python encoder, batch after batch, and encodes most hits itself."""
    from torch_dtorch.runtime import native_replay

    if native_replay.extension() is None:
        pytest.skip("the native extension is not built here (DTORCH_NATIVE=0 or no compiler)")
    native, ref = BatchEncoder(hits=True, native=True), BatchEncoder(hits=True, native=False)
    lane = native.lane
    assert lane is not None
    taken = 0

    def counted(batch: Any, start: int, fastrun: type, *rest: Any) -> int:
        nonlocal taken
        end = lane(batch, start, fastrun, *rest)
        taken += sum(1 for x in batch[start:end] if type(x) is fastrun)
        return end

    native.lane = counted
    for batch in batches:
        assert native.encode(batch) == ref.encode(batch)
        assert native._operands.keys() == ref._operands.keys() and native._tables == ref._tables
    n_fast = sum(type(i) is FastRun for b in batches for i in b)
    assert taken > n_fast // 2, (taken, n_fast)


def capture_mixed() -> list[list[Instruction]]:
    """Batches with what the C++ lane must leave to the Python encoder: outputs that require grad (their templates
    are keyed by the flags), call sites (``debug``), Python fast-path hits (in place: their arguments travel)."""
    mesh = dt.init_device_mesh("cpu", (2,), mode="thread")
    runner = get_session().executor.runner
    batches: list[list[Instruction]] = []
    submit = runner.submit

    def record(batch: Any) -> None:
        batches.append(list(batch))
        submit(batch)

    runner.submit = record  # type: ignore[method-assign]
    cfg = get_config()
    debug = cfg.debug
    try:
        x = dt.distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        b = dt.distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
        for i in range(60):
            x = x * 0.5 + b
            x.mul_(1.0)  # in place: a Python fast-path hit
            if i == 30:
                cfg.debug = True  # call sites from here on
        dt.sync()
    finally:
        cfg.debug = debug
        dt.shutdown()
    # outputs that require grad (as traced training graphs' operands do; eager operands carry no flag): every
    # fourth hit's (each plan gets some; a step makes three), consistently for the operands later hits read
    runs = [i for b in batches for i in b if type(i) is FastRun]
    for run in runs[::4]:
        for o in run.outputs:
            o.requires_grad = True
    return batches


def test_the_native_lane_leaves_grad_call_sites_and_python_hits_to_python() -> None:
    """On batches full of what the lane must not encode, its output still equals the Python encoder's."""
    from torch_dtorch.runtime import native_replay

    if native_replay.extension() is None:
        pytest.skip("the native extension is not built here (DTORCH_NATIVE=0 or no compiler)")
    batches = capture_mixed()
    grad = [i for b in batches for i in b if type(i) is FastRun and any(o.requires_grad for o in i.outputs)]
    sites = [i for b in batches for i in b if type(i) is FastRun and i.call_site is not None]
    args = [i for b in batches for i in b if type(i) is FastRun and i.args is not None]
    assert grad and sites and args, (len(grad), len(sites), len(args))
    native, ref = BatchEncoder(hits=True, native=True), BatchEncoder(hits=True, native=False)
    for batch in batches:
        assert native.encode(batch) == ref.encode(batch)
        assert native._operands.keys() == ref._operands.keys() and native._tables == ref._tables


def test_records_supersede_an_older_definition_of_their_ids(batches: list[list[Instruction]]) -> None:
    """Operand ids defined before — a compiled program's own operands share the eager id space (``LoadProgram``
    defines them) — are superseded by the records that make those ids later: the decoder's table had kept the old
    operand, and a process-mode SD3 pipeline compiled on ``cfg=2`` failed at its fourth step (``redistribute failed
    ... input %87 holds float32[2, 2, 32, 32] but S(0) on this rank needs float32[1, 1, 32]``)."""
    from torch_dtorch.executor.instructions import Upload
    from torch_dtorch.graph import Operand

    made = [o for b in batches for i in b if type(i) is FastRun for o in i.outputs][10:60]
    mesh = made[0].mesh
    stale = [Operand(o.id, (3, 5), torch.float64, mesh, (Replicate(),) * mesh.ndim, (5, 1)) for o in made]
    enc, dec = BatchEncoder(hits=True), BatchDecoder()
    ref_enc, ref_dec = BatchEncoder(hits=False), BatchDecoder()
    foreign: list[Instruction] = [Upload(x, ("k", x.id)) for x in stale]  # (decoded only: never run)
    through_wire(enc, dec, foreign)
    ref_dec.decode(ref_enc.encode(foreign))
    for batch in batches:
        got = list(expand(dec, through_wire(enc, dec, batch)))
        want = ref_dec.decode(ref_enc.encode(batch))
        for a, b in zip(want, got, strict=True):
            same_instr(a, b, views=False)


def test_bytes_per_hit(batches: list[list[Instruction]]) -> None:
    """A record is 3 + n words (64-bit: JSON's short decimal ids are about as small); the signed batches stay
    within a third of the all-JSON ones."""
    sizes = {}
    for on in (False, True):
        enc = BatchEncoder(hits=on)
        sizes[on] = sum(
            memoryview(f).nbytes
            for b in batches
            for f in wire.encode(enc.encode(b), kind=MessageKind.BATCH, seq=1, sender="c", secret=SECRET)
        )
    n_fast = sum(type(i) is FastRun for b in batches for i in b)
    assert sizes[True] / n_fast < 100, sizes
    assert sizes[True] < 1.35 * sizes[False], sizes


# --- malformed and truncated frames ------------------------------------------------------------------------------
class Case:
    """The batch after the first three (with hit records), and decoders primed with those three."""

    def __init__(self, batches: list[list[Instruction]]) -> None:
        enc = BatchEncoder(hits=True)
        self.first = [enc.encode(b) for b in batches[:3]]
        self.tree = enc.encode(batches[3])
        assert self.tree[7], "the batch has records"

    def decoder(self) -> BatchDecoder:
        dec = BatchDecoder()
        for t in self.first:
            dec.decode(t)
        return dec


@pytest.fixture
def case(batches: list[list[Instruction]]) -> Case:
    return Case(batches)


def words_of(tree: list[Any]) -> list[int]:
    return hits.unpack(tree[7], batch_no=0)


def with_words(tree: list[Any], words: list[int], runs: list[Any] | None = None) -> list[Any]:
    tree = list(tree)
    tree[7] = hits.pack(words)
    if runs is not None:
        tree[6] = json.dumps(runs).encode()
    return tree


def first_hit(words: list[int]) -> int:
    p = 0
    while words[p] & 3 == hits.FREE:
        p += 1 + (words[p] >> 2)
    return p


def bad(case: Case, tree: list[Any], match: str) -> None:
    with pytest.raises(CodecError, match=match) as e:
        case.decoder().decode(tree)
    assert "instruction batch" in str(e.value)


def test_frame_not_whole_words(case: Case) -> None:
    tree = case.tree
    tree = list(tree)
    tree[7] = bytes(tree[7])[:-3]
    bad(case, tree, "multiple of 8")


def test_frame_over_the_limit(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    tree = case.tree
    monkeypatch.setattr(hits, "MAX_HIT_BYTES", 64)
    bad(case, tree, "multiple of 8 up to 64")


def test_frame_of_another_type(case: Case) -> None:
    tree = case.tree
    tree = list(tree)
    tree[7] = "not bytes"
    bad(case, tree, "hit frame is str")


def test_unknown_template(case: Case) -> None:
    tree = case.tree
    w = words_of(tree)
    w[first_hit(w)] = 999 << 2
    bad(case, with_words(tree, w), "unknown hit template 999")


def test_unknown_record_kind(case: Case) -> None:
    tree = case.tree
    w = words_of(tree)
    w[first_hit(w)] |= 2
    bad(case, with_words(tree, w), "unknown record kind 2")


def test_negative_ids(case: Case) -> None:
    tree = case.tree
    w = words_of(tree)
    p = first_hit(w)
    w[p + 2] = -5
    bad(case, with_words(tree, w), "out of range")
    w = words_of(tree)
    w[p + 3] = -7
    bad(case, with_words(tree, w), "negative input id|do not match")


def test_truncated_runs(case: Case) -> None:
    tree = case.tree
    runs = json.loads(tree[6])
    w = words_of(tree)
    (k, n) = next((k, r[1]) for k, r in enumerate(runs) if r[0] == "H")
    # the frame ends inside the run
    bad(case, with_words(tree, w[: len(w) - (len(w) - n) - 1]), "truncated|belong to no hit run|holds")
    # the run ends inside a record
    short = [r if j != k else ["H", n - 1] for j, r in enumerate(runs)]
    bad(case, with_words(tree, w, short), "truncated|belong to no hit run")
    # a run longer than the frame
    long = [r if j != k else ["H", len(w) + 1] for j, r in enumerate(runs)]
    bad(case, with_words(tree, w, long), "holds")
    # words no run places
    bad(case, with_words(tree, [*w, 1 << 2 | hits.FREE, 3]), "belong to no hit run")
    # a free record that claims more ids than its run holds
    bad(case, with_words(tree, [*w, 100 << 2 | hits.FREE], [*runs, ["H", 1]]), "free record")
    for count in (0, -1, "3", None):
        bad(case, with_words(tree, w, [*runs, ["H", count]]), "hit run of")


def test_template_defined_out_of_order(batches: list[list[Instruction]]) -> None:
    enc, dec = BatchEncoder(hits=True), BatchDecoder()
    for b in batches:
        tree = enc.encode(b)
        runs = json.loads(tree[6])
        if any(r[0] == "Y" for r in runs):
            runs = [["Y", r[1] + 5, r[2]] if r[0] == "Y" else r for r in runs]
            tree[6] = json.dumps(runs).encode()
            with pytest.raises(CodecError, match="instruction batch .* defined out of order"):
                dec.decode(tree)
            return
        dec.decode(tree)
    pytest.fail("no hit template definition in the batches")


def test_version_1_batch_is_refused() -> None:
    with pytest.raises(CodecError, match=f"format version 1, this worker decodes version {VERSION}"):
        BatchDecoder().decode([MAGIC, 1, 1, True, [], [], b"[]", []])


# --- through a real cluster --------------------------------------------------------------------------------------
@pytest.mark.slow
def test_heartbeat_names_the_op_of_a_record_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The third ``cos`` on one layout is a hit record; kernel hooks make the worker run it on the general path,
    where it hangs: the hang error names ``aten.cos``, as for any other op."""
    dt.shutdown()
    monkeypatch.setenv("DTORCH_WORKER_IMPORTS", "tests.cluster.worker_hooks")
    monkeypatch.setenv("DTORCH_TEST_SLOW_OP", "aten.cos:1:8")
    monkeypatch.setenv("DTORCH_TEST_SLOW_AFTER", "2")
    monkeypatch.setenv("DTORCH_HANG_TIMEOUT_S", "1")
    mesh = dt.init_device_mesh("cpu", (2,), mode="process")
    runner = get_session().executor.runner
    assert isinstance(runner, ClusterRunner)
    pids = [m.proc.pid for m in runner.members.values() if m.proc is not None]
    x = dt.distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    x = torch.cos(torch.cos(x))
    dt.sync()
    words = []
    encode = runner._encoder.encode

    def counting(batch: Any) -> Any:
        tree = encode(batch)
        words.append(len(tree[7] or b"") // 8)
        return tree

    runner._encoder.encode = counting  # type: ignore[method-assign]
    t0 = time.monotonic()
    fut = dt.to_torch_async(torch.cos(x))
    with pytest.raises(WorkerHangError) as e:
        fut.get(timeout=10)
    assert sum(words) >= 4, words  # the cos travelled as a record
    assert time.monotonic() - t0 < 3.0
    assert e.value.worker == "w1" and "aten.cos" in e.value.op, e.value
    assert wait_gone(pids, 5.0) == []
    dt.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("words", "runs", "expect"),
    [
        # the run is longer than the frame
        ([0], [["H", 3]], ["could not decode batch", "hit run of 3 words", "'controller'"]),
        # a template nobody defined
        ([77 << 2, 1, 1 << 20], [["H", 3]], ["could not decode batch", "unknown hit template 77"]),
    ],
    ids=["truncated", "unknown-template"],
)
def test_malformed_records_fail_the_worker_with_a_clear_error(
    words: list[int], runs: list[Any], expect: list[str]
) -> None:
    """A signed batch with malformed records: every worker reports a protocol error naming the batch; the
    controller fails with ``WorkerFailedError`` naming the worker, at once, and no process is left."""
    dt.shutdown()
    mesh = dt.init_device_mesh("cpu", (2,), mode="process")
    runner = get_session().executor.runner
    assert isinstance(runner, ClusterRunner)
    pids = [m.proc.pid for m in runner.members.values() if m.proc is not None]
    x = dt.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    dt.sync()
    with runner._lock:
        enc = runner._encoder
        enc._batch_no += 1
        bad_no = enc._batch_no
        tree = [MAGIC, VERSION, bad_no, False, [], [], json.dumps(runs).encode(), hits.pack(words), []]
        assert runner.net.pub is not None
        runner._batches = runner.net.pub.send(tree, kind=MessageKind.BATCH)
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as e:
        (x + 1).full_tensor()
    assert time.monotonic() - t0 < 5.0
    text = str(e.value)
    assert all(s in text for s in expect) and f"instruction batch {bad_no}" in text, text
    assert "worker w0" in text or "worker w1" in text, text
    assert wait_gone(pids, 6.0) == []
    dt.shutdown()


@pytest.mark.parametrize("hits_on", [True, False])
def test_an_instruction_sees_the_frees_that_follow_it(monkeypatch: pytest.MonkeyPatch, hits_on: bool) -> None:
    """A compiled program donates the inputs freed right after it (``Worker.freed_after``): in process mode those
    frees travel as free records of a hit run, which the worker reads as ``Free``s."""
    from torch_dtorch.backend.program import RunProgram
    from torch_dtorch.executor import worker as worker_mod

    enc, dec = BatchEncoder(hits=hits_on), BatchDecoder()
    batch = dec.decode(enc.encode([RunProgram(7, (1, 2, 3), (9,)), Free([1, 2]), Free([5])]))
    w = worker_mod.Worker(0, "cpu", None, None)
    seen: list[list[int]] = []
    monkeypatch.setitem(
        worker_mod._HANDLERS, RunProgram, lambda wk, instr: seen.append(wk.freed_after(instr))
    )
    w.run_batch(batch)
    assert seen == [[1, 2, 5]]
    assert w.freed_after(batch[0]) == []  # outside run_batch: nothing
