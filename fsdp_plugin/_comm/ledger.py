"""The pairing check off the host's critical path where identity tags do not apply (issue 30: NCCL, gloo with
device tensors; ``ShardingConfig(pairing_check="auto")``).

Every unit collective's code goes into the process's ledger (``tagged.mark``: a position and a code, no
message) and into its rolling hash (``tagged.digest``). Nothing is sent or waited before a collective is
issued. The hash is verified where every rank already meets once per step: the unused-parameter mask
all-reduce at the end of a reducing backward (MAX of uint8s). The token is the hash's 8 bytes followed by
their complements (``255 - b``): after a MAX every byte pair gives the largest and the smallest value of that
byte across ranks, and they are equal on every byte iff every rank had the same hash. The mask all-reduce then
runs on the gloo control group with CPU tensors (``_groups/mesh.control_group``), so a native collective left
stuck by a divergence (one rank issued one more) never delays the verdict behind it on the device stream.

The check runs before the end of backward waits for the last reductions and before the gradients are handed
to the optimizer: a gradient built from mixed data raises with the backward. On a mismatch (rare: one
all-gather of every rank's codes since the last agreed hash, on the control group) every rank raises the same
`CollectiveError` naming each rank's collective at the first divergent position; ``fp.reset`` re-aligns the
ledgers (``tagged.drain``).
"""
from __future__ import annotations

import json
from typing import Optional

import torch

from ..errors import CollectiveError
from . import collectives as comm, deadlines, tagged, transport
from .transport import Transport
from .divergence import divergence_message

TOKEN_BYTES = 16


def token() -> bytes:
    """This rank's ledger hash as the 16 bytes appended to the step's MAX all-reduce."""
    d = tagged.digest().to_bytes(8, "little")
    return d + bytes(255 - b for b in d)


def agreed(merged: bytes) -> bool:
    """``merged``: the MAX-reduced token; True iff every rank's hash was the same."""
    hi, lo = merged[:8], merged[8:TOKEN_BYTES]
    return all(h == 255 - low for h, low in zip(hi, lo))


def verify(merged: bytes, group, timeout_s: Optional[float], hint: str = "") -> None:
    """Raise the divergence on every rank unless the hashes agreed (``merged``: the reduced token).

    Every rank gets the same ``merged``, so every rank takes the same branch: the all-gather of the codes
    below pairs."""
    if agreed(merged):
        tagged.verified()
        return
    mine = json.dumps(tagged.codes_since_verified()).encode()
    everyone = comm.all_gather_bytes(mine, group, what="pairing check: every rank's unit collectives",
                                     timeout_s=comm.default_timeout_s(timeout_s), dev=torch.device("cpu"))
    codes = {r: {p: c for p, c in json.loads(b)} for r, b in enumerate(everyone)}
    message = tagged.first_divergence(codes) or divergence_message(
        "every rank issued the same codes, but their ledger hashes differ")
    counts = {len(c) for c in codes.values()}
    if len(counts) > 1 and transport.of_group() is Transport.STREAM:
        message += (" One rank issued more collectives than another: the NCCL groups may hold a collective that "
                    "can never complete, so they are aborted; restart the process group (the job).")
        _abort_native()
    tagged.set_verdict(message + hint)
    raise CollectiveError(message + hint)


def _abort_native() -> None:
    """Release a native collective that can never complete (the process group is lost anyway)."""
    comm.FAILED = True
    deadlines.abort_group(None)
