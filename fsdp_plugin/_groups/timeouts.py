"""Process-group timeouts against the engine's deadline (issue 53, finding 7).

A collective that never completes is failed by the engine's deadline (``ShardingConfig.timeout_s``, else
``FSDP_PLUGIN_TIMEOUT_S``, 480 s): the monitor (``_comm/deadlines.py``) or gloo's timed wait names the late rank.
torch's own timeout on the group (ProcessGroupNCCL's watchdog, which tears the job down with
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) must fire strictly later, as a backstop, or it races the monitor and the
named error may never print. The engine's own groups get ``backstop_timeout``; the groups it borrows (the world
group, a user's DeviceMesh groups) keep the timeout they were made with, and `check` warns, naming the fix, when
that is not longer than the deadline (changing a user's group behind their back would change their own
collectives' timeouts too).
"""
from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Optional

import torch

from .. import _compat
from .._comm import collectives as comm

BACKSTOP_MARGIN_S = 120.0
_WARNED: set = set()     # (group id, deadline): warn once per process


def backstop_timeout(timeout_s: Optional[float] = None) -> timedelta:
    """The process-group timeout of the engine's own groups: the deadline of ``timeout_s`` (None:
    ``FSDP_PLUGIN_TIMEOUT_S``, 480 s) plus a margin, so that the deadline fires first and names the late rank,
    and torch's watchdog stays the backstop if the monitor itself is stuck."""
    return timedelta(seconds=comm.default_timeout_s(timeout_s) + BACKSTOP_MARGIN_S)


def groups_in_use(mesh, control=None) -> list:
    """(name, group) of every group the engine's collectives run on for ``mesh`` (None: the default group)."""
    out = []
    if mesh.shard_size > 1:
        out.append(("shard", mesh.shard_group))
    if mesh.replicate_size > 1:
        out.append(("replicate", mesh.replicate_group))
    if control is not None:
        out.append(("control", control))
    return out


def check(mesh, timeout_s: Optional[float], device: torch.device, control=None) -> list[str]:
    """Warn once for each group ``mesh`` uses whose torch timeout is not strictly longer than the deadline of
    ``timeout_s``; returns the warnings issued now. Groups whose backend exposes no timeout are not checked."""
    deadline = comm.default_timeout_s(timeout_s)
    issued = []
    for name, group in groups_in_use(mesh, control):
        group = group if group is not None else _compat.default_group()
        limit = _compat.group_timeout(group, device)
        key = (id(group), deadline)
        if limit is None or limit.total_seconds() > deadline or key in _WARNED:
            continue
        _WARNED.add(key)
        which = "the default (world) group" if group is _compat.default_group() else f"the {name} group"
        want = backstop_timeout(timeout_s).total_seconds()
        issued.append(
            f"fsdp_plugin: {which}'s process-group timeout ({limit.total_seconds():.0f} s) is not longer than the "
            f"engine's collective deadline ({deadline:.0f} s): torch's watchdog may end the job before the "
            f"deadline names the late rank. Create the group with a longer timeout, e.g. "
            f"dist.init_process_group(..., timeout=timedelta(seconds={want:.0f})) (a DeviceMesh: its groups' "
            f"timeout), or lower the deadline below {limit.total_seconds():.0f} s with "
            f"ShardingConfig(timeout_s=...) or FSDP_PLUGIN_TIMEOUT_S.")
        warnings.warn(issued[-1], UserWarning, stacklevel=3)
    return issued
