"""At a deadline: read the stuck group's statuses from the store (no collective) and name the late ranks.

A member whose issued count in the stuck group is below the stuck collective's number has not arrived;
one waiting in that same number has; one past it issued other collectives (ranks diverged). A status
that stopped updating (older than a few publication periods) belongs to a dead or frozen process.
See :mod:`fsdp_plugin._comm.status` for what each rank publishes.
"""
from __future__ import annotations

import json
import time
from typing import Optional

import torch.distributed as dist

from . import status
from .status import _DETAILED, _DUMP_KEY, _key, _Op, _snapshot


def ranges(ranks: list) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"`` (a 512-rank list stays one line)."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def report(op: Optional[_Op]) -> str:
    """Sentences naming the late ranks of ``op``'s group and the trace files; "" when nothing is known
    (no numbered operation, no store). Publishes this rank's status and asks every rank for its trace."""
    if op is None or op.seq is None or not dist.is_initialized():
        return ""
    me = dist.get_rank()
    try:
        store = status.report_store()
        store.set(_key(me), json.dumps(_snapshot(None)))
        if not store.check([_DUMP_KEY]) or _stale(store.get(_DUMP_KEY).decode()):
            store.set(_DUMP_KEY, f"{time.time()}|rank {me} at {op.label()}")
            status.notify(store)
        pub = status._S.publisher
        if pub is not None:            # this rank writes its own file below, with the stack of this moment
            pub.dumped = store.get(_DUMP_KEY).decode()
        statuses = _read(store, [r for r in status._S.members.get(op.group, []) if r != me])
    except Exception as e:  # noqa: BLE001 - the store host died too: say so, keep the plain message
        return f"(The ranks' status could not be read from the rendezvous store: {str(e).splitlines()[0][:120]}.)"
    pub = status._S.publisher       # the monitor's thread reports: the stack worth writing is the training thread's
    path = status.write_trace(f"deadline in {op.label()}", tid=pub.tid if pub is not None else None)
    return " ".join(filter(None, [_describe(op, statuses), _trace_note(path)]))


def _read(store, ranks: list) -> dict:
    """rank -> status dict, or None for a rank that never published (never blocks on a missing key)."""
    keys = [_key(r) for r in ranks]
    if keys and not store.check(keys):
        present = [r for r, k in zip(ranks, keys) if store.check([k])]
    else:
        present = ranks
    values = store.multi_get([_key(r) for r in present]) if present else []
    got = {r: json.loads(v) for r, v in zip(present, values)}
    # a status from before this process started belongs to a previous attempt of the job: no status of this one
    return {r: s if s is not None and s["t"] >= status._S.born else None for r, s in ((r, got.get(r)) for r in ranks)}


def _stale(request: str) -> bool:
    t = request.partition("|")[0]
    try:
        return float(t) < status._S.born
    except ValueError:
        return True


def _classify(op: _Op, statuses: dict) -> tuple[list, list, list, list]:
    """(not arrived, waiting in the same collective, past it, never published), each a list of ranks."""
    late, same, past, silent = [], [], [], []
    for r, s in statuses.items():
        if s is None:
            silent.append(r)
            continue
        n = s["seq"].get(op.group, 0)
        cur = s.get("cur")
        if n < op.seq:
            late.append(r)
        elif (cur and cur[0] == op.seq and cur[1] == op.group) or ("done" in s and s["done"].get(op.group, 0) < op.seq):
            # blocked in it on the host, or (a stream transport: the host ran ahead) issued but not completed
            # there either: the same collective is stuck on both ranks, a hang rather than a divergence
            same.append(r)
        else:
            past.append(r)
    return late, same, past, silent


def _describe(op: _Op, statuses: dict) -> str:
    late, same, past, silent = _classify(op, statuses)
    now, parts = time.time(), []
    if late:
        shown = [_late_rank(statuses[r], now) for r in late[:_DETAILED]]
        more = f" ({len(late) - _DETAILED} more late: ranks {ranges(late[_DETAILED:])})" if len(late) > _DETAILED else ""
        parts.append(f"Not arrived at #{op.seq}: " + "; ".join(shown) + more + ".")
    if silent:
        parts.append(f"No status from rank(s) {ranges(silent)} in this attempt (dead or stuck before their first "
                     "collective, or another store).")
    if past:
        parts.append(f"Rank(s) {ranges(past)} already issued #{op.seq} and more "
                     f"({_past_rank(statuses[past[0]], now)}): the ranks ran different collectives "
                     "(rank-dependent code around the model or a collective).")
    parts.append(f"Waiting in #{op.seq} too: rank(s) {ranges(same)}." if same else "")
    if not late and not silent and not past:
        parts.append("Every rank is inside this collective: the transport failed (network, NCCL) rather than a rank.")
    return " ".join(p for p in parts if p)


def _ago(t: Optional[float], now: float) -> str:
    return f"{max(now - t, 0.0):.1f}s ago" if t is not None else "at an unknown time"


def _late_rank(s: dict, now: float) -> str:
    text = f"rank {s['rank']} (host {s['host']}, pid {s['pid']}) "
    if s.get("cur"):
        text += f"waits in {s['cur'][2]} since {_ago(s['cur'][3], now)}"
    elif s.get("last"):
        text += f"last finished {s['last'][2]} {_ago(s['last'][3], now)}"
    else:
        text += "has issued no collective yet"
    if s.get("where"):
        text += f", now at {s['where']}"
    age = now - s["t"]
    if age > 2 * status.period() + 1.0:
        return text + f"; its status stopped updating {age:.0f}s ago: the process is dead or frozen (holding the GIL)"
    return text + f" (its status of {age:.1f}s ago)"     # published every period(): a fast loop moves on meanwhile


def _past_rank(s: dict, now: float) -> str:
    cur = s.get("cur") or s.get("last")
    return f"rank {s['rank']}: {cur[2]}" if cur else f"rank {s['rank']}"


def _trace_note(path: Optional[str]) -> str:
    if path is None:
        return f"(No trace file: {status.trace_dir()} is not writable; set FSDP_PLUGIN_TRACE_DIR.)"
    return (f"Last {status.RING} collectives of this rank: {path}; every rank writes its own "
            "rank<r>.log there (on its host) within a second; set FSDP_PLUGIN_TRACE_DIR to choose the folder.")
