"""The rule after a collective failure on a stream transport (NCCL): nothing computed after it is kept.

On NCCL the host does not wait for collectives (``deadlines.py``): by the time the deadline monitor fails a stuck
collective and aborts its group, the host may have queued the gradient accumulation and the optimizer step
behind it, and those kernels then run on garbage. So a failure found by the monitor **poisons the process's
training state**: every later step, save and export refuses (``refuse``) with an error naming the failure and the
last checkpoint this process saved before it, and the job restarts from there (torchrun's restart, or by hand).
Nothing is half-applied to a checkpoint. The same holds for torch's own watchdog
(``TORCH_NCCL_ASYNC_ERROR_HANDLING``), which tears the process down.

A divergence found by the pairing check (``ledger.py``) is not poisoning: it raises at the end of backward,
before any gradient reaches the optimizer, and ``fp.reset`` discards that step's gradients.
"""
from __future__ import annotations

from typing import Optional

from ..errors import CollectiveError

_POISON: list = []              # the first monitor failure of this process (it outlives fp.shutdown)
_LAST_SAVED: list = []          # the last checkpoint this process saved completely


def poison(error: BaseException) -> BaseException:
    """Record the monitor's failure (its ``make_error`` passes the error through here)."""
    if not _POISON:
        _POISON.append(error)
    return error


def saved(path) -> None:
    """A checkpoint was saved completely (every rank's files published)."""
    _LAST_SAVED[:] = [str(path)]


def poisoned() -> Optional[BaseException]:
    return _POISON[0] if _POISON else None


def refuse(what: str) -> None:
    """Raise if a collective failed on a stream transport in this process (see the module docstring)."""
    if not _POISON:
        return
    cause = str(_POISON[0]).splitlines()[0][:400]
    last = f"the last checkpoint this process saved before it: {_LAST_SAVED[0]}" if _LAST_SAVED else \
        "this process saved no checkpoint before it"
    raise CollectiveError(
        f"{what} refused: a collective failed earlier in this process ({cause}). On NCCL the host had already "
        "queued work behind it, which ran on garbage once the group was aborted, so this process's parameters, "
        f"gradients and optimizer state cannot be trusted; nothing was written. Restart the job from {last}.")

import os as _os  # noqa: E402
_os.register_at_fork(after_in_child=lambda: (_POISON.clear(), _LAST_SAVED.clear()))
