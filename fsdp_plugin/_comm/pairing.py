"""Collective pairing: every rank enters the same unit's collective, at every step (issue 26).

Collectives pair by issue order alone. A unit that runs on some ranks only (a branch on the rank's data, a unit
whose output misses the loss on one rank) would pair one unit's all-gather with another's: gloo aborts the
process (a message longer than the receive buffer) and NCCL exchanges the wrong data when the sizes agree.

The engine therefore issues one tiny blocking **pairing check** right before each of its per-unit collectives
(``Unit.unshard`` when a handle will all-gather, ``Reduction.grad_ready`` when a reduction communicates)
and at the two places where a rank's per-unit collectives may end early (the end of the root's forward, the
end of backward before the unused-parameter mask all-reduce). Every rank all-gathers one int64 (``code``: what
it is about to do, and for which unit) and compares: equal codes, go on; any difference raises
`CollectiveError` on every rank at once, naming what every rank was entering. The check is sound by
construction: two ranks can only be in different checks when all their earlier collectives paired, so the
checks themselves always pair (same size, same kind) and the mismatched data collective is never issued.

Cost: one round trip of ``8 * world`` bytes per check (counted as ``kind="control"``), a few per unit per step;
measured in benchmarks/pairing_overhead.py. On NCCL the checks travel on a gloo group of the same ranks
(``_groups.mesh.control_group``), so reading the verdict never waits for the GPU.
"""
from __future__ import annotations

from enum import IntEnum
from typing import Optional, Sequence

import torch

from ..errors import CollectiveError
from . import collectives as comm


class Entering(IntEnum):
    """What a rank is about to do, in the pairing code."""

    ALL_GATHER = 0
    REDUCTION = 1
    END_OF_FORWARD = 2
    END_OF_BACKWARD = 3


_UNIT_BITS = 32


def code(entering: Entering, unit_index: int = 0) -> int:
    return (int(entering) << _UNIT_BITS) | unit_index


def describe(c: int, units: Sequence) -> str:
    """``c`` in words; ``units``: every unit (``.name``), indexed by the code's unit number."""
    entering, index = Entering(c >> _UNIT_BITS), c & ((1 << _UNIT_BITS) - 1)
    name = repr(units[index].name) if index < len(units) else f"#{index}"
    if entering is Entering.ALL_GATHER:
        return f"all-gather of unit {name}"
    if entering is Entering.REDUCTION:
        return f"gradient reduction of unit {name}"
    return "end of forward" if entering is Entering.END_OF_FORWARD else "end of backward"


def agree(c: int, units: Sequence, group, world_size: int, timeout_s: Optional[float], hint: str = "") -> None:
    """Blocking: every rank of ``group`` (``world_size`` ranks, CPU tensors) passes the same code ``c``, else a
    CollectiveError on every rank naming each rank's next collective (``describe`` over ``units``) and ending
    with ``hint`` (the model's likely cause, the same on every rank)."""
    mine = torch.tensor([c], dtype=torch.int64)
    everyone = torch.empty(world_size, dtype=torch.int64)
    work = comm.all_gather(everyone, mine, group, async_op=True, kind="control")
    comm.wait(work, f"pairing check before {describe(c, units)}", timeout_s)  # a deadline names the unit
    seen = everyone.tolist()
    if any(s != c for s in seen):
        names = "; ".join(f"rank {r}: {describe(s, units)}" for r, s in enumerate(seen))
        raise CollectiveError(
            f"ranks diverged: their next collectives belong to different units, so they would pair wrongly ({names}). Every rank must run the "
            "same units in the same order, and every unit's output must reach the loss on every rank or on none "
            "(no rank-dependent branches around sharded modules; declare a module that runs on some ranks only, e.g. a "
            "vision tower, in ShardingConfig(some_ranks_modules={...}), or put it inside a unit that runs everywhere)"
            + hint)
