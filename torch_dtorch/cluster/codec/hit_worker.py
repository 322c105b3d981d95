"""The workers' handler of :class:`~torch_dtorch.cluster.codec.hits.HitRun`: a run of binary hit records.

A record whose template this worker already resolved to a native call is queued on the native chain by operand id:
no ``RunOp``, ``Operator``, ``OpCall`` or ``Operand`` is made for it. Anything else — the template's first record
on this worker (it resolves there), a poisoned or missing input, replay off, validation or kernel hooks, a call the
native loop cannot take — is materialized into its ``RunOp`` and run like any other instruction (sticky errors,
hooks and heartbeat progress as on the general path). Frees between the hits free blobs in order.

Registered when :mod:`torch_dtorch.cluster.codec` is imported, so whoever decodes batches can run them.
"""

from __future__ import annotations

from torch_dtorch.cluster.codec.hits import FREE, HitRun
from torch_dtorch.executor.worker import Worker, register_instruction

__all__ = ["run_hits"]


@register_instruction(HitRun)
def run_hits(worker: Worker, run: HitRun) -> None:
    """Run the records ``run`` holds on ``worker`` (see the module docstring)."""
    dec, words = run.dec, run.words
    hts = dec._tables["hit"]
    chain = worker.replay_chain()
    resolved = worker.resolved_call
    device = worker.device
    blobs = worker.blobs
    progress = dec.progress
    p, end = run.start, run.end
    try:
        while p < end:
            w = words[p]
            if w & 3 == FREE:
                q = p + 1 + (w >> 2)
                if chain is not None and len(chain):
                    chain.free(words[p + 1 : q])
                else:
                    pop = blobs.pop
                    for i in words[p + 1 : q]:
                        pop(i, None)
                p = q
                continue
            ht = hts[w >> 2]
            q = p + 3 + ht.n_slots
            if device in ht.devices:
                if chain is not None:
                    call = resolved(ht.tm)
                    if call is not None and call.native >= 0:
                        ins = words[p + 3 : q]
                        if not ht.dense:
                            ins = [i for i in ins if i >= 0]
                        first = words[p + 2]
                        outs = [first] if ht.n_out == 1 else list(range(first, first + ht.n_out))
                        if chain.add(call.native, ht.op, ins, outs, None):
                            worker.executed += 1
                            worker.replayed += 1
                            p = q
                            continue
                instr = dec.materialize(ht, words[p + 1], words[p + 3 : q], words[p + 2])
                if progress is not None:
                    progress(f"{instr.node.name} -> %{words[p + 2]}")
                worker.run_one(instr, chain)
            p = q
    finally:
        if chain is not None and len(chain):
            chain.flush()
