"""Matmul family, einsum-driven: ONE builder turns an einsum equation into the signatures of every matmul-like op.

Every op is described by an equation over its product operands (``mm``: ``mk,kn->mn``; ``bmm``: ``bmk,bkn->bmn``;
``mv``/``addmv``: ``mk,k->m``; ``dot``/``vdot``: ``k,k->``; ``matmul``/``linear``: built from the shapes, batch dims
broadcast; ``einsum``: parsed, ``...`` and implicit output included) plus, for ``addmm``/``baddbmm``/``addmv``/
``linear``, an *addend* (the bias) broadcast to the output. ``vdot`` conjugates its first operand locally: the
conjugate is additive, so a contracted (sharded) ``k`` still gives ``P(sum)`` and the linearity signatures hold.

Signatures (one mesh axis):
- **free / batch letter** (in the output): every operand that has the letter at full size is ``S`` on that dim,
  operands without it (or with a broadcast size 1) are ``R`` -> output ``S`` on the letter's dim; the addend is ``S``
  on its aligned dim if it has it at full size, else ``R``. E.g. ``mm(S(0), R) -> S(0)``, ``mm(R, S(1)) -> S(1)``,
  ``linear(R, S(0)) -> S(-1)`` (column parallel).
- **contracted letter** (not in the output): every operand that has it at full size is ``S`` on it, the others ``R``
  -> ``P(sum)``; ``mm(S(1), S(0)) -> P(sum)``, ``linear(S(-1), S(1)) -> P(sum)`` (row parallel).
- **linearity**: one product operand ``P(sum|avg)``, the other operands ``R`` -> same ``P``.
- **addend**: ``bias + P`` is not linear in the product alone, so every Partial signature requires the addend to be
  the *same* Partial (``beta·Σb_r + alpha·Σp_r = Σ(beta·b_r + alpha·p_r)``); a replicated bias reaches it for free
  (zero-fill on all but one rank), so the bias is added once, not once per rank (e.g. ``addmv(R, S(1), S(0))``
  runs as ``addmv(P(sum), S(1), S(0)) -> P(sum)``).
- a letter repeated inside one operand (``ii->i``) gets no sharded signature (a placement shards one dim per axis).

Costs are ``2·batch·M·N·K`` (``matmul_cost``): batch = letters in the output and in both operands, M/N = output
letters of only the first/second operand, K = letters not in the output; einsum over other than two operands sums a
left-to-right pairwise contraction. ``matmul``, ``linear`` and ``einsum`` are CompositeImplicitAutograd: intercepted.
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torch_dtorch import _compat
from torch_dtorch.graph import OperatorCost
from torch_dtorch.ops.cost import matmul_cost, traffic_cost
from torch_dtorch.placement import LINEAR_REDUCE_OPS, Partial, Placement, Replicate, Shard
from torch_dtorch.placement_rules.call import LocalContext, OpCall
from torch_dtorch.placement_rules.inplace import InplaceRule
from torch_dtorch.placement_rules.rule import get_rule, register_rule
from torch_dtorch.placement_rules.signature import PlacementSignature, sig

__all__ = ["Einsum", "einsum_signatures", "matmul_equation", "parse_einsum"]

aten = torch.ops.aten
_R = Replicate()
_LETTERS = string.ascii_uppercase + string.ascii_lowercase


# --- the einsum description -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Einsum:
    """An einsum over concrete shapes: one subscript letter per dim of every operand and of the output."""

    inputs: tuple[str, ...]
    output: str
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every letter (the largest: size-1 dims broadcast)."""
        out: dict[str, int] = {}
        for sub, shape in zip(self.inputs, self.shapes):
            for c, n in zip(sub, shape):
                out[c] = max(out.get(c, n), n)
        return out

    def dims(self) -> tuple[int, int, int, int]:
        """``(batch, M, N, K)`` of a two-operand contraction."""
        a, b = self.inputs
        size = self.sizes
        batch = math.prod(size[c] for c in self.output if c in a and c in b)
        m = math.prod(size[c] for c in self.output if c in a and c not in b)
        n = math.prod(size[c] for c in self.output if c in b and c not in a)
        k = math.prod(size[c] for c in size if c not in self.output)
        return batch, m, n, k

    def flops(self) -> int:
        """FLOPs of a left-to-right pairwise contraction (``2·batch·M·N·K`` for two operands)."""
        size = self.sizes
        if len(self.inputs) == 1:
            return math.prod(size.values())
        flops, cur = 0, self.inputs[0]
        for i, nxt in enumerate(self.inputs[1:], 1):
            later = set(self.output).union(*self.inputs[i + 1 :])
            letters = set(cur) | set(nxt)
            flops += 2 * math.prod(size[c] for c in letters)
            cur = "".join(sorted(c for c in letters if c in later))
        return flops


def parse_einsum(equation: str, shapes: Sequence[Sequence[int]]) -> Einsum:
    """Parse a torch einsum equation (``...`` broadcasting, implicit output, spaces) for concrete operand shapes."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    subs = lhs.split(",")
    used = set(eq) & set(_LETTERS)
    if len(subs) != len(shapes) or not set(eq) <= used | set(".,->") or any(s.count("...") > 1 for s in subs):
        raise NotImplementedError(f"einsum: unsupported equation {equation!r} for {len(shapes)} operand(s)")
    spare = [c for c in _LETTERS if c not in used]
    ell_nd = [len(shape) - len(s.replace("...", "")) if "..." in s else 0 for s, shape in zip(subs, shapes)]
    n_ell = max(ell_nd, default=0)
    if n_ell > len(spare) or min(ell_nd, default=0) < 0:
        raise NotImplementedError(f"einsum: unsupported equation {equation!r}")
    ell = "".join(spare[:n_ell])
    inputs = tuple(s.replace("...", ell[n_ell - k :]) for s, k in zip(subs, ell_nd))
    if arrow:
        output = rhs.replace("...", ell)
    else:
        once = [c for c in sorted(set(lhs) & used) if lhs.count(c) == 1]
        output = ell + "".join(once)
    if any(len(s) != len(shape) for s, shape in zip(inputs, shapes)) or "." in output:
        raise NotImplementedError(
            f"einsum: unsupported equation {equation!r} for shapes {[list(s) for s in shapes]}"
        )
    return Einsum(inputs, output, tuple(tuple(s) for s in shapes))


def matmul_equation(a_nd: int, b_nd: int) -> str:
    """The einsum equation of ``torch.matmul`` for operand ranks (1-d vectors, broadcast batch dims)."""
    if a_nd == 0 or b_nd == 0:
        raise NotImplementedError("matmul: both arguments need at least 1 dimension")
    batch = "abcdefghijlopqrstuvwxyz"[: max(a_nd, b_nd) - 2] if max(a_nd, b_nd) > 2 else ""
    ba = batch[len(batch) - max(a_nd - 2, 0) :] if a_nd > 2 else ""
    bb = batch[len(batch) - max(b_nd - 2, 0) :] if b_nd > 2 else ""
    a = ba + ("mk" if a_nd >= 2 else "k")
    b = bb + ("kn" if b_nd >= 2 else "k")
    out = batch + ("m" if a_nd >= 2 else "") + ("n" if b_nd >= 2 else "")
    return f"{a},{b}->{out}"


# --- the shared signature builder -----------------------------------------------------------------------------------


def einsum_signatures(e: Einsum) -> list[tuple[tuple[Placement, ...], Placement]]:
    """(operand placements, output placement) for every legal sharding of one mesh axis (see module doc)."""
    size = e.sizes
    repeated = {c for s in e.inputs for c in s if s.count(c) > 1}
    out: list[tuple[tuple[Placement, ...], Placement]] = []
    for c in dict.fromkeys("".join(e.inputs)):
        if c in repeated:
            continue
        ins: tuple[Placement, ...] = tuple(
            Shard(s.index(c)) if c in s and shape[s.index(c)] == size[c] else _R
            for s, shape in zip(e.inputs, e.shapes)
        )
        out.append((ins, Shard(e.output.index(c)) if c in e.output else Partial("sum")))
    # all-Replicate before the Partial ones: on a cost tie (gathering a shard) a Replicate output wins
    out.append(((_R,) * len(e.inputs), _R))
    for reduce_op in LINEAR_REDUCE_OPS:
        p = Partial(reduce_op)
        for i in range(len(e.inputs)):
            out.append((tuple(p if j == i else _R for j in range(len(e.inputs))), p))
    return out


def _addend_placement(out_p: Placement, addend_shape: Sequence[int], out_shape: Sequence[int]) -> Placement:
    """The bias next to an output placement: same Partial, ``S`` on its aligned dim at full size, else ``R``."""
    if isinstance(out_p, Partial):
        return out_p
    if type(out_p) is Shard:
        aligned = out_p.dim - (len(out_shape) - len(addend_shape))
        if aligned >= 0 and addend_shape[aligned] == out_shape[out_p.dim]:
            return Shard(aligned)
    return _R


# --- per-op equations -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    """How an overload maps to an einsum: the equation, the product operands' slots and the addend's slot."""

    equation: Callable[[OpCall], str]
    operands: tuple[int, ...] = (0, 1)
    addend: int | None = None


def _fixed(eq: str) -> Callable[[OpCall], str]:
    return lambda call: eq


def _shape(call: OpCall, slot: int) -> tuple[int, ...]:
    x = call.inputs[slot]
    assert x is not None
    return tuple(x.shape)


def _linear_eq(call: OpCall) -> str:
    nd, w_nd = len(_shape(call, 0)), len(_shape(call, 1))
    batch = "abcdefghijlmopqrstuvwxyz"[: nd - 1]
    return f"{batch}k,{'nk' if w_nd == 2 else 'k'}->{batch}{'n' if w_nd == 2 else ''}"


_SPECS: dict[Any, _Spec] = {
    aten.mm.default: _Spec(_fixed("mk,kn->mn")),
    aten.bmm.default: _Spec(_fixed("bmk,bkn->bmn")),
    aten.addmm.default: _Spec(_fixed("mk,kn->mn"), (1, 2), addend=0),
    aten.baddbmm.default: _Spec(_fixed("bmk,bkn->bmn"), (1, 2), addend=0),
    aten.mv.default: _Spec(_fixed("mk,k->m")),
    aten.addmv.default: _Spec(_fixed("mk,k->m"), (1, 2), addend=0),
    aten.dot.default: _Spec(_fixed("k,k->")),
    aten.vdot.default: _Spec(_fixed("k,k->")),
    aten.matmul.default: _Spec(lambda call: matmul_equation(len(_shape(call, 0)), len(_shape(call, 1)))),
    aten.linear.default: _Spec(_linear_eq, addend=2),
}


def _spec(call: OpCall) -> _Spec:
    if call.op is aten.einsum.default:
        return _Spec(lambda c: str(c.arg("equation")), tuple(range(len(call.inputs))))
    return _SPECS[call.op]


def call_einsum(call: OpCall) -> Einsum:
    """The :class:`Einsum` of a matmul-family call."""
    spec = _spec(call)
    return parse_einsum(spec.equation(call), [_shape(call, i) for i in spec.operands])


def matmul_signatures(call: OpCall) -> list[PlacementSignature]:
    spec = _spec(call)
    e = call_einsum(call)
    out_shape = call.out_meta[0].shape
    addend = call.inputs[spec.addend] if spec.addend is not None else None
    sigs: dict[PlacementSignature, None] = {}
    for ins, out_p in einsum_signatures(e):
        slots: list[Placement] = [_R] * len(call.inputs)
        for slot, p in zip(spec.operands, ins):
            slots[slot] = p
        if spec.addend is not None and addend is not None:
            slots[spec.addend] = _addend_placement(out_p, addend.shape, out_shape)
        sigs[sig(slots, out_p)] = None
    return list(sigs)


def _matmul_cost(call: OpCall) -> OperatorCost:
    e = call_einsum(call)
    if len(e.inputs) != 2:
        return traffic_cost(call.inputs, call.out_meta, flops=e.flops())
    batch, m, n, k = e.dims()
    return matmul_cost(call.inputs, call.out_meta, m=m, n=n, k=k, batch=batch)


def _addmv_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``addmv`` on the shards; an empty output block (an empty shard of the rows) skips it: torch's ``addmv`` of an
    empty matrix returns the bias' shape (``(1,)`` or ``()`` for a broadcast bias), not the empty block."""
    shape = ctx.out_shapes[0]
    if math.prod(shape) == 0:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        return torch.empty(shape, dtype=call.out_meta[0].dtype, device=device)
    return call.op(*args, **kwargs)


def _einsum_kernel(call: OpCall, ctx: LocalContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``einsum`` of one operand may return a view of it (``ij->ji``): the output is a fresh tensor here."""
    out = call.op(*args, **kwargs)
    tensors = args[1] if len(args) > 1 else kwargs.get("tensors", ())
    if out.numel() > 0 and any(isinstance(t, torch.Tensor) and _compat.is_alias_of(t, out) for t in tensors):
        out = out.clone()
    return out


# --- registrations ------------------------------------------------------------------------------------------------


@register_rule(
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
    aten.baddbmm.default,
    aten.mv.default,
    aten.dot.default,
    aten.vdot.default,
    family="matmul",
    cost=_matmul_cost,
)
def matmul_family(call: OpCall) -> list[PlacementSignature]:
    """Einsum-driven: shard free/batch letters consistently, contracted letters -> ``P(sum)``, linear in each arg."""
    return matmul_signatures(call)


register_rule(aten.addmv.default, family="matmul", cost=_matmul_cost, kernel=_addmv_kernel)(matmul_family)
# the kernel above only guards an empty block, so ``addmv_`` (a full-size ``self``) derives as usual; derived
# variants skip rules with their own kernel, so it is registered here
register_rule(aten.addmv_.default, family="matmul")(
    InplaceRule(get_rule(aten.addmv.default), aten.addmv.default)
)


@register_rule(aten.matmul.default, aten.linear.default, family="matmul", intercept=True, cost=_matmul_cost)
def matmul_composite(call: OpCall) -> list[PlacementSignature]:
    """``matmul`` (any ranks, broadcast batch dims) and ``linear`` (weight ``[out, in]``, optional bias)."""
    return matmul_signatures(call)


@register_rule(aten.einsum.default, family="matmul", intercept=True, cost=_matmul_cost, kernel=_einsum_kernel)
def einsum(call: OpCall) -> list[PlacementSignature]:
    """``einsum`` with any number of operands, ``...`` and implicit output."""
    return matmul_signatures(call)
