"""``PlacementSignature``: one legal (inputs -> outputs) placement combination of an op on ONE mesh axis.

Signatures are matched per mesh axis: on every axis the inputs' placements on that axis must equal one signature's
inputs (an absent optional tensor matches anything), and the outputs get that signature's placements on that axis.

    sig = SignatureBuilder().add_input(Shard(0)).add_input(Replicate()).add_output(Shard(0)).build()
    str(sig)  # '(S(0), R) -> S(0)'
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch_dtorch.placement import Placement, Replicate, placement_str

__all__ = ["PlacementSignature", "SignatureBuilder", "all_replicate", "sig"]

_R = Replicate()


@dataclass(frozen=True)
class PlacementSignature:
    """Placements of every tensor input slot and every output on one mesh axis."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement, ...]
    optional: frozenset[int] = frozenset()

    def matches(self, placements: Sequence[Placement | None]) -> bool:
        if len(placements) != len(self.inputs):
            return False
        return all(p is None or p == q for p, q in zip(placements, self.inputs, strict=True))

    @property
    def is_all_replicate(self) -> bool:
        return all(type(p) is Replicate for p in (*self.inputs, *self.outputs))

    def __str__(self) -> str:
        ins = ", ".join(
            placement_str(p) + ("?" if i in self.optional else "") for i, p in enumerate(self.inputs)
        )
        outs = ", ".join(placement_str(p) for p in self.outputs)
        if len(self.outputs) != 1:
            outs = f"({outs})"
        return f"({ins}) -> {outs}"


class SignatureBuilder:
    """Builds one :class:`PlacementSignature`: inputs in schema order, then outputs."""

    def __init__(self) -> None:
        self._inputs: list[Placement] = []
        self._outputs: list[Placement] = []
        self._optional: set[int] = set()

    def add_input(self, p: Placement) -> SignatureBuilder:
        self._inputs.append(p)
        return self

    def add_optional_input(self, p: Placement) -> SignatureBuilder:
        """An optional tensor slot (e.g. ``bias``); when the call passes ``None`` the slot matches anything."""
        self._optional.add(len(self._inputs))
        self._inputs.append(p)
        return self

    def add_inputs(self, ps: Iterable[Placement]) -> SignatureBuilder:
        for p in ps:
            self.add_input(p)
        return self

    def add_output(self, p: Placement) -> SignatureBuilder:
        self._outputs.append(p)
        return self

    def build(self) -> PlacementSignature:
        if not self._outputs:
            raise ValueError("SignatureBuilder.build: a signature needs at least one output")
        return PlacementSignature(tuple(self._inputs), tuple(self._outputs), frozenset(self._optional))


def sig(inputs: Sequence[Placement], outputs: Sequence[Placement] | Placement) -> PlacementSignature:
    """Shorthand for the builder: ``sig([S(0), R], S(0))``."""
    b = SignatureBuilder().add_inputs(inputs)
    for p in outputs if isinstance(outputs, Sequence) else (outputs,):
        b.add_output(p)
    return b.build()


def all_replicate(num_inputs: int, num_outputs: int) -> PlacementSignature:
    """The signature every deterministic op has: all inputs Replicate -> all outputs Replicate."""
    return PlacementSignature((_R,) * num_inputs, (_R,) * num_outputs)
