"""What a rank enters, in words, and the message of a divergence: shared by both pairing checks (``pairing``:
announcements; ``tagged``: identity tags). Imports nothing of the engine."""
from __future__ import annotations

import contextlib
from enum import IntEnum
from typing import Sequence

_UNIT_BITS = 32
_abandoning = [False]        # inside fp.reset: a divergent collective's wait returns quietly


class Entering(IntEnum):
    """What a rank is about to do, in the pairing code."""

    ALL_GATHER = 0
    REDUCTION = 1
    END_OF_FORWARD = 2
    END_OF_BACKWARD = 3
    REALIGN = 4         # fp.reset after a divergence: pairs with whatever the other ranks have left in flight


def describe(c: int, units: Sequence) -> str:
    """``c`` in words; ``units``: every unit (``.name``), indexed by the code's unit number."""
    entering, index = Entering(c >> _UNIT_BITS), c & ((1 << _UNIT_BITS) - 1)
    name = repr(units[index].name) if index < len(units) else f"#{index}"
    if entering is Entering.ALL_GATHER:
        return f"all-gather of unit {name}"
    if entering is Entering.REDUCTION:
        return f"gradient reduction of unit {name}"
    return {Entering.END_OF_FORWARD: "end of forward", Entering.END_OF_BACKWARD: "end of backward"}.get(
        entering, "fp.reset")


def divergence_message(names: str, hint: str = "") -> str:
    """The CollectiveError text of a divergence; ``names``: what each rank was entering."""
    return (f"ranks diverged: their next collectives belong to different units, so they would pair wrongly "
            f"({names}). Every rank must run the same units in the same order, and every unit's output must reach "
            "the loss on every rank or on none (no rank-dependent branches around sharded modules; declare a module that "
            "runs on some ranks only, e.g. a vision tower, in ShardingConfig(some_ranks_modules={...}), or put it inside "
            "a unit that runs everywhere). Call fp.reset(model) on every rank before the next step." + hint)


def is_abandoning() -> bool:
    return _abandoning[0]


@contextlib.contextmanager
def abandoning():
    """fp.reset's cleanup: waits of mismatched gates return quietly (their data was never sent; the buffers
    are dropped with the step) instead of raising the divergence again."""
    _abandoning[0] = True
    try:
        yield
    finally:
        _abandoning[0] = False
