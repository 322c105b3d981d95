"""The workers' handler of :class:`~torch_dtorch.cluster.codec.hits.HitRun`: a run of binary hit records.

A record whose template this worker already resolved to a native call is queued on the native chain by operand id:
no ``RunOp``, ``Operator``, ``OpCall`` or ``Operand`` is made for it. Anything else — the template's first record
on this worker (it resolves there), a poisoned or missing input, replay off, validation or kernel hooks, a call the
native loop cannot take — is materialized into its ``RunOp`` and run like any other instruction (sticky errors,
hooks and heartbeat progress as on the general path). Frees between the hits free blobs in order. The queueing
itself is C++ (``NativeChain.queue_records``): the worker process spends no Python per queued record.

Registered when :mod:`torch_dtorch.cluster.codec` is imported, so whoever decodes batches can run them.
"""

from __future__ import annotations

from torch_dtorch.cluster.codec.hits import FREE, HitRun
from torch_dtorch.executor.worker import Worker, register_instruction

__all__ = ["run_hits"]


@register_instruction(HitRun)
def run_hits(worker: Worker, run: HitRun) -> None:
    """Run the records ``run`` holds on ``worker`` (see the module docstring). With the native chain, runs of
    queueable records and free records go through ``NativeChain.queue_records`` (C++); a hit record it stops at is
    materialized here."""
    dec, words = run.dec, run.words
    hts = dec._tables["hit"]
    chain = worker.replay_chain()
    resolved = worker.resolved_calls()
    device = worker.device
    blobs = worker.blobs
    progress = dec.progress
    p, end = run.start, run.end
    try:
        while p < end:
            if chain is not None:
                p, queued = chain.queue_records(
                    words, p, end, templates=hts, resolved=resolved, device=device, free_kind=FREE
                )
                worker.executed += queued
                worker.replayed += queued
                if p >= end:
                    break
            w = words[p]
            if w & 3 == FREE:  # (without a chain: the lane takes free records)
                q = p + 1 + (w >> 2)
                pop = blobs.pop
                for i in words[p + 1 : q]:
                    pop(i, None)
                p = q
                continue
            ht = hts[w >> 2]
            q = p + 3 + ht.n_slots
            if device in ht.devices:  # (with a chain: a hit the lane could not queue)
                instr = dec.materialize(ht, words[p + 1], words[p + 3 : q], words[p + 2])
                if progress is not None:
                    progress(f"{instr.node.name} -> %{words[p + 2]}")
                worker.run_one(instr, chain)
            p = q
    finally:
        if chain is not None and len(chain):
            chain.flush()
