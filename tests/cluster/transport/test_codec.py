"""Instruction batches through the codec (and the signed wire format): round trips of every instruction kind, cache
behaviour, errors, and programs run by ThreadRunner workers on decoded batches vs on the original objects."""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from tests.cluster.transport.loopback import CodecLoopbackRunner
from tests.executor.programs import Feeding, mlp, mlp_torch
from torch_dtorch.cluster import codec
from torch_dtorch.cluster.codec import BatchDecoder, BatchEncoder, CodecError, register_codec
from torch_dtorch.cluster.codec.hits import FREE, HitRun
from torch_dtorch.cluster.transport import wire
from torch_dtorch.executor.constructor import REDISTRIBUTE, GraphConstructor
from torch_dtorch.executor.eager import EagerGraphExecutor
from torch_dtorch.executor.instructions import Barrier, Fetch, Free, Instruction, Redistribute, RunOp, Upload
from torch_dtorch.executor.thread_runner import ThreadRunner
from torch_dtorch.graph import LogicalGraph, Operand
from torch_dtorch.mesh import DeviceMesh
from torch_dtorch.placement import Partial, Replicate, Shard
from torch_dtorch.placement_rules import get_rule

aten = torch.ops.aten
R = Replicate()
SECRET = secrets.token_bytes(32)


# --- helpers ----------------------------------------------------------------------------------------------------
class Recorder:
    """A GraphConstructor whose operators become instructions, as the eager executor makes them."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.g = GraphConstructor(LogicalGraph(record=False), default_mesh=mesh)
        self.instrs: list[Instruction] = []
        self.g.listeners.append(
            lambda n: self.instrs.append(Redistribute(n, "f.py:1") if n.op == REDISTRIBUTE else RunOp(n))
        )

    def take(self) -> list[Instruction]:
        out, self.instrs = self.instrs, []
        return out


def through_wire(enc: BatchEncoder, dec: BatchDecoder, batch: list[Any], seq: int = 1) -> list[Instruction]:
    frames = wire.encode(enc.encode(batch), kind=wire.MessageKind.BATCH, seq=seq, sender="c", secret=SECRET)
    return dec.decode(wire.decode(frames, secret=SECRET).body)


def same_operand(
    a: Operand | None, b: Operand | None, seen: set[int] | None = None, *, views: bool = True
) -> None:
    """``views=False``: ``b`` may lack the base and view of a view ``a`` (a hit record's outputs: workers keep no view
    metadata)."""
    if a is None or b is None:
        assert a is None and b is None
        return
    assert (a.id, a.shape, a.dtype, a.stride, a.mesh, a.placements, a.requires_grad, a.tag) == (
        b.id,
        b.shape,
        b.dtype,
        b.stride,
        b.mesh,
        b.placements,
        b.requires_grad,
        b.tag,
    )
    assert (a.mesh is None) == (b.mesh is None) and (a.mesh is None or a.mesh.root_axes == b.mesh.root_axes)
    if not views and b.base is None and b.view is None:
        return
    same_operand(a.base, b.base)
    same_operand(a.copy_of, b.copy_of)
    assert (a.view is None) == (b.view is None)
    if a.view is not None and b.view is not None:
        assert a.view.op is b.view.op
        same_value(a.view.args, b.view.args)


def same_value(a: Any, b: Any, *, views: bool = True) -> None:
    assert type(a) is type(b), (a, b)
    if isinstance(a, Operand):
        same_operand(a, b, views=views)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same_value(x, y, views=views)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same_value(a[k], b[k], views=views)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b) and math.copysign(1, a) == math.copysign(1, b), (a, b)  # a NaN keeps its sign
    elif isinstance(a, complex):
        same_value(a.real, b.real)
        same_value(a.imag, b.imag)
    elif isinstance(a, float):
        assert a == b and math.copysign(1, a) == math.copysign(1, b)
    else:
        assert a == b


def same_instr(a: Instruction, b: Instruction, *, views: bool = True) -> None:
    assert type(a) is type(b) or (type(a) is Free and type(b) is HitRun)
    if isinstance(a, RunOp | Redistribute):
        assert isinstance(b, RunOp | Redistribute)
        n, m = a.node, b.node
        assert (n.id, n.op, n.family, n.note, n.assign, n.cost, a.call_site) == (
            m.id,
            m.op,
            m.family,
            m.note,
            m.assign,
            m.cost,
            b.call_site,
        )
        same_value((n.args, n.kwargs), (m.args, m.kwargs), views=views)
        same_value(n.inputs, m.inputs, views=views)
        same_value(n.outputs, m.outputs, views=views)
        if isinstance(a, Redistribute):
            assert n.payload == m.payload  # RedistributePlan: meshes, placements and steps by value
        else:
            c, d = n.payload.call, m.payload.call
            assert m.payload.rule is n.payload.rule is get_rule(n.op)
            assert (
                c.op is d.op
                and c.mesh == d.mesh
                and c.placements == d.placements
                and c.out_meta == d.out_meta
            )
            same_value((c.args, c.kwargs, c.inputs), (d.args, d.kwargs, d.inputs), views=views)
            # the kernel maps operands in args to shards by identity: args must hold the inputs' objects
            ids = {id(x) for x in d.inputs if x is not None}
            assert all(id(x) in ids for x in pytree.tree_leaves((d.args, d.kwargs)) if isinstance(x, Operand))
    elif isinstance(a, Upload | Fetch):
        assert isinstance(b, Upload | Fetch)
        same_operand(a.operand, b.operand)
        same_value(a.key, b.key)
        if isinstance(a, Fetch):
            assert isinstance(b, Fetch)
            assert a.devices == b.devices
    elif isinstance(a, Free):
        if isinstance(b, HitRun):  # codec v2: frees travel as binary records
            assert b.words[b.start : b.end] == [len(a.operand_ids) << 2 | FREE, *a.operand_ids]
        else:
            assert isinstance(b, Free)
            assert a.operand_ids == b.operand_ids
    else:
        assert isinstance(a, Barrier) and isinstance(b, Barrier)
        same_value(a.key, b.key)


def mixed_batch(mesh: DeviceMesh) -> list[Instruction]:
    """Every instruction kind; views, in-place ops, factories, kwargs, sub-meshes and constants of many types."""
    rec = Recorder(mesh)
    g = rec.g
    x = g.input((6, 4), mesh, [Shard(0), R], tag="x")
    w = g.input((4, 8), mesh["tp"], [Shard(1)], tag="w")  # a sub-mesh view
    y = g.call(aten.mm.default, x, w)
    v = g.call(aten.view.default, y, [6, 2, 4])
    t = g.call(aten.transpose.int, v, 0, -1)
    g.call(aten.add_.Tensor, y, y, alpha=-0.0)
    z = g.call(aten.add.Tensor, x, 1.5)
    g.call(aten.add.Tensor, x, True)
    g.call(aten.mul.Tensor, x, torch.tensor(3.0))  # a tensor constant: sent by value
    g.call(aten.full.default, [3, 5], float("nan"), dtype=torch.float64, placements=[[R, Shard(1)]])
    g.call(aten.zeros.default, torch.Size([2, 3]), dtype=torch.int64, layout=torch.strided)
    g.call(aten.split.Tensor, z, 2, 1)
    g.call(aten.cat.default, [x, z], 1)
    g.call(aten.sum.dim_IntList, x, [0, 1], keepdim=True)
    g.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    g.redistribute(t, [R, R])
    g.redistribute(y, [Shard(1), Shard(0)])
    p = g.call(aten.mm.default, g.input((6, 8), mesh, [R, Shard(1)]), g.input((8, 3), mesh, [R, Shard(0)]))
    g.redistribute(p, [R, Shard(1)])
    out = rec.take()
    return [
        Upload(x, 7),
        *out,
        Fetch(t, 9, (0, 2)),
        Free([x.id, 12345]),
        Barrier(10),
        Upload(x, (3, 1)),  # x was freed: it is defined again
    ]


@pytest.fixture
def mesh() -> DeviceMesh:
    return DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


# --- round trips ------------------------------------------------------------------------------------------------
def test_round_trip_every_instruction_kind(mesh: DeviceMesh) -> None:
    batch = mixed_batch(mesh)
    kinds = {type(i) for i in batch}
    assert kinds == {RunOp, Redistribute, Upload, Fetch, Free, Barrier}
    enc, dec = BatchEncoder(), BatchDecoder()
    got = through_wire(enc, dec, batch)
    assert len(got) == len(batch)
    for a, b in zip(batch, got):
        same_instr(a, b)
    # the same operand decodes to one object wherever it appears (the kernel relies on identity)
    first = got[1]
    assert isinstance(first, RunOp) and isinstance(got[0], Upload)
    assert first.node.inputs[0] is got[0].operand
    # tensor constants travel as frames and come back equal
    mul = next(i for i in got if isinstance(i, RunOp) and i.node.op is aten.mul.Tensor)
    assert isinstance(mul.node.args[1], torch.Tensor) and mul.node.args[1].item() == 3.0


def test_second_batch_uses_ids_and_templates(mesh: DeviceMesh) -> None:
    rec = Recorder(mesh)
    x = rec.g.input((6, 4), mesh, [Shard(0), R])
    enc, dec = BatchEncoder(), BatchDecoder()
    sizes = []
    for i in range(3):
        y = rec.g.call(aten.relu.default, rec.g.call(aten.add.Tensor, x, 2))
        batch = [*rec.take(), Fetch(y, i, (0,))]
        tree = enc.encode(batch)
        sizes.append(len(tree[6]))
        for a, b in zip(batch, dec.decode(tree)):
            same_instr(a, b)
    run_tree = json.loads(tree[6])[0]
    assert run_tree[0] == "R" and type(run_tree[3]) is int, run_tree  # a template ref, not a definition
    assert run_tree[2] == [x.id, None], run_tree  # a known operand travels as its id (scalar slot: None)
    assert sizes[2] < sizes[0] / 2, sizes


def test_constants_keep_their_types(mesh: DeviceMesh) -> None:
    """1, 1.0 and True are equal in Python: each must still reach the worker with its own type (and -0.0, nan)."""
    rec = Recorder(mesh)
    x = rec.g.input((4,), mesh, [R, R], dtype=torch.int64)
    nan = float("nan")
    consts = [1, 1.0, True, -0.0, 0.0, nan, -nan, float("inf"), 2**40, 0j, complex(-0.0, -0.0)]
    for c in consts:
        rec.g.call(aten.add.Tensor, x, c)
    enc, dec = BatchEncoder(), BatchDecoder()
    got = through_wire(enc, dec, rec.take())
    for c, instr in zip(consts, got):
        assert isinstance(instr, RunOp)
        same_value(c, instr.node.args[1])


def test_value_round_trip() -> None:
    enc, dec = BatchEncoder(), BatchDecoder()
    values = [
        None,
        "text",
        [1, (2, 3.5), {"k": [torch.float16, torch.device("cpu")]}],
        torch.Size([2, 0, 3]),
        torch.channels_last,
        torch.sparse_coo,
        complex(1.5, -2.0),
        Shard(1),
        Partial("avg"),
        float("-inf"),
        -float("nan"),
        complex(-0.0, float("nan")),
    ]
    trees = [enc.value(v) for v in values]
    back = [dec.value(json.loads(json.dumps(t))) for t in trees]
    for v, b in zip(values, back):
        same_value(v, b)


def test_free_forgets_and_redefines(mesh: DeviceMesh) -> None:
    rec = Recorder(mesh)
    x = rec.g.input((4, 4), mesh, [R, R])
    enc, dec = BatchEncoder(), BatchDecoder()
    dec.decode(enc.encode([Upload(x, 0)]))
    tree = enc.encode([Free([x.id]), Upload(x, 1)])
    upload = json.loads(tree[6])[1]
    assert isinstance(upload[1], list), "after Free the operand is defined again"
    got = dec.decode(tree)
    assert isinstance(got[1], Upload)
    same_operand(x, got[1].operand)


# --- errors ---------------------------------------------------------------------------------------------------
def test_unknown_instruction_type_and_tag(mesh: DeviceMesh) -> None:
    @dataclass(frozen=True)
    class Mystery:
        n: int

    enc, dec = BatchEncoder(), BatchDecoder()
    with pytest.raises(CodecError, match="no codec for instruction type .*Mystery.*register_codec"):
        enc.encode([Mystery(1)])
    tree = enc.encode([Barrier(0)])
    tree[6] = json.dumps([["Q?", 1]]).encode()
    with pytest.raises(CodecError, match=r"unknown instruction tag 'Q\?'.*register_codec"):
        dec.decode(tree)


def test_unknown_op_overload(mesh: DeviceMesh) -> None:
    rec = Recorder(mesh)
    x = rec.g.input((4,), mesh, [R, R])
    rec.g.call(aten.relu.default, x)
    enc, dec = BatchEncoder(), BatchDecoder()
    tree = enc.encode(rec.take())
    tree[6] = tree[6].replace(b"aten::relu.default", b"aten::no_such_op.default")
    with pytest.raises(CodecError, match="unknown op overload 'aten::no_such_op.default'"):
        dec.decode(tree)
    tree[6] = tree[6].replace(b"aten::no_such_op.default", b"aten::relu.out")  # exists, but has no rule
    with pytest.raises(CodecError, match="unknown op overload 'aten::relu.out': no placement rule"):
        BatchDecoder().decode(tree)


def test_version_order_and_reset(mesh: DeviceMesh) -> None:
    enc, dec = BatchEncoder(), BatchDecoder()
    tree = enc.encode([Barrier(0)])
    bad = list(tree)
    bad[1] = codec.VERSION + 1
    with pytest.raises(
        CodecError, match=f"format version {codec.VERSION + 1}.*decodes version {codec.VERSION}"
    ):
        dec.decode(bad)
    dec.decode(tree)
    enc.encode([Barrier(1)])  # lost
    with pytest.raises(CodecError, match="batch 3 arrived after batch 1"):
        dec.decode(enc.encode([Barrier(2)]))
    with pytest.raises(CodecError, match="not an instruction batch"):
        dec.decode({"x": 1})
    enc.reset()  # a new session: the next batch makes every decoder start over
    assert isinstance(dec.decode(enc.encode([Barrier(3)]))[0], Barrier)


def test_failed_encode_resets_both_sides(mesh: DeviceMesh) -> None:
    rec = Recorder(mesh)
    x = rec.g.input((4,), mesh, [R, R])
    enc, dec = BatchEncoder(), BatchDecoder()
    dec.decode(enc.encode([Upload(x, 0)]))
    with pytest.raises(CodecError, match="cannot encode a constant of type object"):
        enc.encode([Upload(rec.g.input((2,), mesh, [R, R]), 1), Barrier(object())])
    got = dec.decode(enc.encode([Fetch(x, 2, (0,))]))  # carries the reset flag and x's definition again
    assert isinstance(got[0], Fetch) and got[0].operand.shape == (4,)


def test_register_codec_for_a_new_instruction(mesh: DeviceMesh) -> None:
    @dataclass(frozen=True)
    class RunProgram:
        program: int
        handles: tuple[Operand, ...]
        dtype: torch.dtype
        ops: tuple[Any, ...] = ()

    register_codec(
        RunProgram,
        tag="test.RunProgram",
        encode=lambda i, ctx: [
            i.program,
            [ctx.operand(h) for h in i.handles],
            ctx.value(i.dtype),
            [ctx.operator(n) for n in i.ops],  # type: ignore[attr-defined]
        ],
        decode=lambda t, ctx: RunProgram(
            t[0],
            tuple(ctx.operand(h) for h in t[1]),
            ctx.value(t[2]),
            tuple(ctx.operator(n) for n in t[3]),  # type: ignore[attr-defined]
        ),
    )
    with pytest.raises(CodecError, match="already registered"):
        register_codec(RunProgram, tag="test.other", encode=lambda i, c: 0, decode=lambda t, c: 0)
    with pytest.raises(CodecError, match="built-in tag"):
        register_codec(int, tag="R", encode=lambda i, c: 0, decode=lambda t, c: 0)
    rec = Recorder(mesh)
    a, b = rec.g.input((2,), mesh, [R, R]), rec.g.input((3,), mesh, [Shard(0), R])
    rec.g.redistribute(rec.g.call(aten.neg.default, b), [R, R])
    ops = tuple(i.node for i in rec.take())  # type: ignore[union-attr]
    enc, dec = BatchEncoder(), BatchDecoder()
    got = through_wire(enc, dec, [Upload(a, 0), RunProgram(5, (a, b), torch.bfloat16, ops)])
    prog = got[1]
    assert isinstance(prog, RunProgram) and prog.program == 5 and prog.dtype is torch.bfloat16
    assert prog.handles[0] is got[0].operand  # type: ignore[union-attr]
    same_operand(b, prog.handles[1])
    assert len(prog.ops) == 2 and prog.ops[0].inputs[0] is prog.handles[1]
    for n, m in zip(ops, prog.ops):
        same_instr(
            RunOp(n) if n.op != REDISTRIBUTE else Redistribute(n),
            RunOp(m) if m.op != REDISTRIBUTE else Redistribute(m),
        )


# --- execution: decoded batches run exactly like the originals --------------------------------------------------
@pytest.fixture(scope="module")
def runners() -> Iterator[tuple[EagerGraphExecutor, EagerGraphExecutor, DeviceMesh]]:
    mesh = DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plain = EagerGraphExecutor(ThreadRunner(mesh.devices))
    loop = EagerGraphExecutor(CodecLoopbackRunner(mesh.devices))
    yield plain, loop, mesh
    plain.shutdown()
    loop.shutdown()


def _run(ex: EagerGraphExecutor, mesh: DeviceMesh, op: Any, args: Any, kwargs: Any, variant: int) -> Any:
    """``op`` on dtorch operands made from the sample's tensors (placements chosen by ``variant``); returns the
    fetched outputs, or the exception type."""
    k = iter(range(100))

    def wrap(t: torch.Tensor) -> Operand:
        i = next(k)
        opts = [R, Shard(0) if t.ndim else R, Partial() if t.is_floating_point() else R]
        pl = [opts[(variant + i) % 3], opts[variant % 3]] if variant else [R, R]
        o = ex.input(tuple(t.shape), mesh, pl, dtype=t.dtype)
        ex.upload(o, t.clone())
        return o

    try:
        a, kw = pytree.tree_map_only(torch.Tensor, wrap, (args, kwargs))
        out = ex.call(op, *a, **kw)
        outs = out if isinstance(out, (list, tuple)) else [out]
        return [ex.fetch(o).get(30) for o in outs]
    except Exception as e:  # noqa: BLE001 - both runners must fail alike
        return type(e)


def _compare_runners(runners: Any, op: Any, sample: Any, variant: int) -> bool:
    """Whether both runners produced values (they must match) rather than the same error."""
    plain, loop, mesh = runners
    kwargs = dict(sample.kwargs)
    if sample.out_placements is not None or not any(isinstance(a, torch.Tensor) for a in sample.args):
        kwargs.update(
            device_mesh=mesh, placements=[[R, sample.out_placements[0] if sample.out_placements else R]]
        )
    want = _run(plain, mesh, op, sample.args, kwargs, variant)
    got = _run(loop, mesh, op, sample.args, kwargs, variant)
    where = f"{op} variant {variant}"
    if isinstance(want, type):
        assert got is want, f"{where}: plain runner raised {want.__name__}, loopback gave {got}"
        return False
    assert isinstance(got, list) and len(got) == len(want), f"{where}: {got}"
    for k, (w, g) in enumerate(zip(want, got)):
        assert w.shape == g.shape and w.dtype == g.dtype, where
        if sample.compare and k not in sample.unspecified_outputs:
            torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
    return True


def _samples() -> dict[Any, list[Any]]:
    from tests.rules.test_all_rules import SAMPLES

    return SAMPLES


REPRESENTATIVE = [
    aten.add.Tensor,  # pointwise/broadcast
    aten.mm.default,  # matmul
    aten.linear.default,  # composite
    aten.sum.dim_IntList,  # reduction
    aten.view.default,  # views
    aten.transpose.int,
    aten.split.Tensor,
    aten.cat.default,  # shape (a Tensor[] argument)
    aten.add_.Tensor,  # in-place
    aten.zeros.default,  # factories
    aten.arange.start_step,
    aten.layer_norm.default,  # normalization
    aten.softmax.int,
    aten.scaled_dot_product_attention.default,  # attention
    aten.embedding.default,  # embedding / indexing
]


@pytest.mark.parametrize("op", REPRESENTATIVE, ids=str)
def test_representative_ops_match_plain_runner(runners: Any, op: Any) -> None:
    sample = _samples()[op][0]
    ran = [_compare_runners(runners, op, sample, variant) for variant in range(3)]
    assert all(ran), f"{op}: some variants failed on both runners: {ran}"


@pytest.mark.slow
def test_every_rule_sample_matches_plain_runner(runners: Any) -> None:
    ran = 0
    for op, samples in sorted(_samples().items(), key=lambda kv: str(kv[0])):
        for sample in samples:
            for variant in range(3):
                ran += _compare_runners(runners, op, sample, variant)
    assert ran > 1000, ran


def test_every_redistribute_kind_matches_plain_runner(runners: Any) -> None:
    plain, loop, mesh = runners
    value = torch.randn(5, 7)
    moves = [
        ([Shard(0), Shard(1)], [R, R]),  # all-gather
        ([Partial(), R], [R, R]),  # all-reduce
        ([Partial("max"), R], [Shard(1), R]),  # reduce-scatter
        ([Shard(0), R], [Shard(1), R]),  # all-to-all
        ([R, R], [Shard(0), Shard(1)]),  # local slice
        ([R, R], [R, Partial("avg")]),  # zero-fill
    ]
    stages = mesh.unbind("dp")
    for src, dst in moves:
        results = []
        for ex in (plain, loop):
            x = ex.input(value.shape, mesh, src)
            ex.upload(x, value)
            y = ex.redistribute(x, dst)
            z = ex.redistribute(y, [Shard(0)], device_mesh=stages[1])  # cross-mesh: point-to-point
            results.append([ex.fetch(y).get(30), ex.fetch(z).get(30)])
        for w, g in zip(*results):
            assert torch.equal(w, g), f"{src} -> {dst}"
            torch.testing.assert_close(g, value)


def test_mlp_end_to_end_through_the_codec() -> None:
    mesh = DeviceMesh.from_shape("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ins, _ = mlp(GraphConstructor(default_mesh=mesh), mesh)
    values = {n: torch.randn(o.shape) for n, o in ins.items()}
    runner = CodecLoopbackRunner(mesh.devices)
    with EagerGraphExecutor(runner) as ex:
        _, outs = mlp(Feeding(ex, values), mesh)
        got = [ex.fetch(o).get(30) for o in outs]
        ex.free(outs[0])
        ex.sync(timeout=30)
    assert runner.seq >= 2 and runner.num_bytes > 0
    for g, w in zip(got, mlp_torch(values)):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
