"""The integrations' one "gather to rank 0, write there" save (library formats ``fp.save_pretrained`` cannot
write: Lightning's torch file, the Trainer's model folder, a library's own ``save_pretrained``)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

import fsdp_plugin as fp
from fsdp_plugin.checkpoint import _comm

T = TypeVar("T")


def write_on_rank0(model: torch.nn.Module, write: Callable[[dict[str, Any]], T], op: str) -> T | None:
    """Collective: gather ``model``'s plain state dict to rank 0 (``fp.full_state_dict``) and call
    ``write(state_dict)`` there only; returns its result on rank 0, None elsewhere.

    A failure of ``write`` raises on every rank (on the others as a copy naming rank 0), so none waits
    forever; the final agreement is also the barrier after which the files exist. Deadlines: the model's
    ``timeout_s``; errors name ``op``.
    """
    with _comm.deadline_of(model, op):
        state = fp.full_state_dict(model)  # rank 0 gets every tensor, the other ranks {}
        result, err = None, None
        if _comm.rank() == 0:
            try:
                result = write(state)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                err = e
        _comm.raise_if_any_failed(err)
    return result
