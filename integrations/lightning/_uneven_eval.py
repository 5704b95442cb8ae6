"""Uneven validation and test batches under ``Trainer(strategy="fsdp_plugin")``: each evaluation epoch whose
ranks have different (or unknown: ``IterableDataset``) numbers of batches runs inside ``fp.join(model)``
(``fsdp_plugin/_schedule/eval_join.py``).

One all-reduce at the epoch's start compares the ranks' batch counts; when they are equal and finite nothing
else happens. Otherwise each ``validation_step``/``test_step`` joins a one-element count, and a rank whose
epoch ends first replays its last step (under no_grad, its logs discarded) right after its last batch, in
``on_*_batch_end`` (this callback is the first one; Lightning's prefetching fetcher knows the last batch
before it runs, ``batch_progress.is_last_batch``), so before anything that may use collectives: the epoch's
metric sync runs before any ``on_*_epoch_end`` hook. A rank with no batch at all has nothing to replay:
every rank raises UsageError at once instead of hanging. Each rank's logged epoch values are those of its own batches,
as with DDP. Contract: no collective in per-batch evaluation code (``self.log(..., sync_dist=True)`` syncs at
the epoch's end, which is fine).
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

import fsdp_plugin as fp


def install(trainer: Any) -> None:
    """Put :class:`UnevenEvaluation` first in ``trainer.callbacks`` (once)."""
    if not any(isinstance(c, UnevenEvaluation) for c in trainer.callbacks):
        trainer.callbacks.insert(0, UnevenEvaluation())


def _counts(trainer: Any, stage: str) -> list:
    if stage == "test":
        return list(trainer.num_test_batches)
    return list(trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches)


def _uneven(trainer: Any, stage: str) -> bool:
    """One all-reduce: whether the ranks' batch counts for this evaluation epoch differ or are unknown."""
    n = sum(_counts(trainer, stage))
    mine = -1.0 if math.isinf(n) else float(n)
    t = torch.tensor([mine, -mine], dtype=torch.float64, device=trainer.strategy.root_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    high, low = t[0].item(), -t[1].item()
    return high != low or low < 0


@contextmanager
def _logs_discarded(module: Any) -> Iterator[None]:
    """A replayed step's ``self.log`` calls would add values of batches this rank does not have."""
    module.log, module.log_dict = (lambda *a, **k: None), (lambda *a, **k: None)
    try:
        yield
    finally:
        del module.log, module.log_dict


class UnevenEvaluation(Callback):
    """Internal: the strategy puts it first in ``trainer.callbacks`` on more than one rank."""

    def __init__(self) -> None:
        self._open: Optional[Any] = None

    def _start(self, trainer: Any, module: Any, stage: str) -> None:
        if trainer.world_size == 1 or not fp.is_sharded(module) or not _uneven(trainer, stage):
            return
        self._open = fp.join(module)
        self._open.__enter__()
        if sum(_counts(trainer, stage)) == 0:     # no batch here: the count tells every rank (UsageError)
            self._end(module)

    def _batch_end(self, trainer: Any, module: Any) -> None:
        if self._open is not None and trainer._evaluation_loop.batch_progress.is_last_batch:
            self._end(module)

    def _end(self, module: Any) -> None:
        if self._open is None:
            return
        ctx, self._open = self._open, None
        with _logs_discarded(module):
            ctx.__exit__(None, None, None)

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module, "validation")

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._batch_end(trainer, pl_module)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(pl_module)     # already closed after the last batch, unless Lightning did not flag it

    def on_test_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._start(trainer, pl_module, "test")

    def on_test_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        self._batch_end(trainer, pl_module)

    def on_test_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._end(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._open is not None:
            ctx, self._open = self._open, None
            ctx.__exit__(type(exception), exception, exception.__traceback__)
