"""Uneven training batches across ranks: every training epoch of ``Trainer(strategy="fsdp_plugin")`` runs
inside torch's ``Join`` over the sharded LightningModule (``fsdp_plugin/_schedule/join.py``), unless every
rank has the same finite number of batches that epoch (one all-reduce at its start decides).

A rank whose epoch ends first (fewer batches: ``use_distributed_sampler=False`` with per-rank data of
different lengths, an ``IterableDataset``, ``limit_train_batches``...) leaves the Join right after its last
real step, in ``on_train_batch_end`` (this callback is the first one, so the step and the optimizer are done,
and no user hook of that batch has run a collective yet), and shadows the others' steps there until the
last rank's epoch ends; then every rank goes on to validation, ``on_train_epoch_end`` and checkpoints together.
Lightning's prefetching fetcher knows that a batch is the last before it runs (``batch_progress.is_last_batch``,
or the sized loader's length), so the decision uses Lightning's own end-of-epoch test, not an exhausted iterator.

Gradients are divided by the initial world size (``divide_by_initial_world_size=True``, the default DDP +
Join users get): a shadowed step equals one process on the global batch in which the joined ranks'
samples count zero, i.e. the loss ``sum over active ranks of their mean loss / world_size``.

Besides the model's own shadow step (the last ``training_step`` replayed with a zero loss), each shadowed
batch on a joined rank does what Lightning's loop does around a step on the others:

* the per-batch SIGTERM broadcast of ``_TrainingEpochLoop.advance`` (issued once more when leaving: the
  broadcast of the step that the others start next);
* the counters: ``global_step`` (so ``max_steps`` and checkpoint names agree), the logging step, and the
  ``interval="step"`` learning-rate schedulers (stepped after the shadow's optimizer step, as the others do).

The shadow replays ``training_step`` itself (the engine replays the registered entry point), so its
``self.log(..., sync_dist=True)`` pairs with the others' (the joined rank adds the value of its last batch;
its logged metrics of shadowed steps are those of the replay). Contract (as with DDP + Join): no other
collective in per-batch code while ranks are uneven: ``self.log(..., sync_dist=True)`` outside
``training_step``, ``strategy.reduce``/barriers in ``on_train_batch_*`` hooks,
``every_n_train_steps`` checkpoints and mid-epoch validation (``val_check_interval < 1``) each rank would
schedule by its own batch count. With ``accumulate_grad_batches``, give every rank a multiple of it (else a
UsageError on every rank). Manual optimization (its ``training_step`` runs backward and the optimizers
itself, so it cannot be replayed with a zero loss) and ``16-mixed`` (the gradient scaler's inf check is a
collective) are not shadowed: there the Join only detects uneven batches (``throw_on_early_termination``)
and every rank raises instead of hanging.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer import call
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from fsdp_plugin._schedule.join import state_of
from fsdp_plugin.integrations.lightning import _tensor_parallel
from fsdp_plugin.errors import UsageError


def install(trainer: Any) -> None:
    """Put :class:`UnevenInputs` first in ``trainer.callbacks`` (once): its ``on_train_batch_end`` must run
    before any user hook of the last batch, which may use collectives."""
    if not any(isinstance(c, UnevenInputs) for c in trainer.callbacks):
        trainer.callbacks.insert(0, UnevenInputs())


@contextmanager
def accumulating(model: torch.nn.Module) -> Iterator[None]:
    """A micro-batch of ``accumulate_grad_batches`` that reduces gradients but steps no optimizer: a joined
    rank's shadow must do the same."""
    state = state_of(model)
    if state is None:
        yield
        return
    before, state.accumulating = state.accumulating, True
    try:
        yield
    finally:
        state.accumulating = before


class UnevenInputs(Callback):
    """Internal: the strategy puts it first in ``trainer.callbacks`` when fitting on more than one rank."""

    def __init__(self) -> None:
        self._join: Optional[Join] = None
        self._model: Any = None
        self._loop: Optional[_LoopShadow] = None

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.world_size > 1 and state_of(trainer.strategy.model) is not None and not _even_epoch(trainer):
            _tensor_parallel.refuse_uneven(_tensor_parallel.tp_size(trainer.strategy))
            self._model, self._loop = trainer.strategy.model, _LoopShadow(trainer, trainer.strategy.model)
            self._join = Join([self._model, self._loop], divide_by_initial_world_size=True,
                              throw_on_early_termination=not _shadowable(trainer, pl_module))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._join is not None and _epoch_ends_after_this_batch(trainer):
            self._loop.validates = _validates_now(trainer)
            _per_batch_collectives(trainer)  # the broadcast of the others' next step
            self._leave(pl_module)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """The epoch ended without our last-batch test seeing it (the fetcher raised StopIteration in a further
        ``advance``, or ``on_train_batch_start`` returned -1): that advance already made its broadcast."""
        if self._join is not None:
            self._leave(pl_module)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Later forwards are plain (no Join counting); the other ranks meet their own error or deadline."""
        state = state_of(self._model) if self._model is not None else None
        if state is not None:
            state.close()
        self._join = None

    def _leave(self, pl_module: Any) -> None:
        """Shadow the others' steps until every rank is here. The shadow replays ``training_step``, so its
        ``self.log`` calls land in ``training_step``'s results (no new metric keys, no extra epoch-end sync)."""
        join, self._join = self._join, None
        fx, pl_module._current_fx_name = pl_module._current_fx_name, "training_step"
        try:
            join.__exit__(None, None, None)
        except RuntimeError as e:
            if "exhausted all inputs" not in str(e):  # torch's throw_on_early_termination message
                raise
            self.on_exception(None, pl_module, e)
            raise UsageError(f"rank {dist.get_rank()} ran out of training batches before the others, with manual "
                             "optimization or a gradient scaler (16-mixed): uneven batches are only shadowed under "
                             "automatic optimization without one. Give every rank the same number of batches "
                             "(use_distributed_sampler=True, drop_last=True, or limit_train_batches).") from e
        finally:
            pl_module._current_fx_name = fx


def _even_epoch(trainer: Any) -> bool:
    """Every rank has the same finite number of training batches this epoch (what the DistributedSampler
    default gives): no Join is needed, so even data pays one 2-element all-reduce per epoch instead of Join's
    two per step. Unsized loaders (an ``IterableDataset``) count as uneven."""
    n = trainer.num_training_batches
    mine = n if isinstance(n, int) or (isinstance(n, float) and math.isfinite(n)) else -1
    counts = torch.tensor([mine, -mine], dtype=torch.int64, device=trainer.strategy.model.join_device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    most, fewest = counts[0].item(), -counts[1].item()
    return most == fewest and fewest >= 0


def _shadowable(trainer: Any, pl_module: Any) -> bool:
    """Manual optimization runs backward and the optimizers inside ``training_step`` (no zero-loss replay);
    a gradient scaler's inf check is a collective the shadow does not make."""
    return pl_module.automatic_optimization and getattr(trainer.precision_plugin, "scaler", None) is None


def _epoch_ends_after_this_batch(trainer: Any) -> bool:
    """Lightning's own end-of-epoch test (``_TrainingEpochLoop.done``), read after the batch's step."""
    loop = trainer.fit_loop.epoch_loop
    return bool(loop._is_training_done or (trainer.should_stop and trainer.fit_loop._can_stop_early))


def _validates_now(trainer: Any) -> bool:
    """Whether Lightning will validate after this batch (``on_advance_end``), from this rank's counts."""
    loop = trainer.fit_loop.epoch_loop
    return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def _agree_on_validation(trainer: Any, validates: bool, is_last_joiner: bool, device: torch.device) -> None:
    """After the Join: validate only if the last ranks to finish do. A rank that ran out of batches would
    validate at its end of epoch, while the others may stop earlier in theirs (``max_steps``), without.
    One MIN all-reduce per epoch, on every rank."""
    flag = torch.tensor([1 if validates or not is_last_joiner else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    loop = trainer.fit_loop.epoch_loop
    if validates and not flag.item() and hasattr(loop, "_skip_next_val"):
        loop._skip_next_val = True


def _per_batch_collectives(trainer: Any) -> None:
    """The collectives Lightning's loop makes per training batch outside the step: Lightning 2.5+ broadcasts
    rank 0's SIGTERM flag at the start of every ``advance`` (raising SIGTERMException here too if set)."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor") and dist.is_initialized() and trainer.world_size > 1:
        loop._broadcast_sigterm_tensor()


def _count_shadow_batch(trainer: Any, index: int, stepped: bool) -> None:
    """What the others' loop counted for their batch ``index`` (0-based in the epoch), if it stepped."""
    if not stepped:
        return
    loop = trainer.fit_loop.epoch_loop
    progress = loop.automatic_optimization.optim_progress.optimizer.step  # global_step (automatic optimization)
    progress.increment_ready()
    progress.increment_completed()
    loop._batches_that_stepped += 1
    _step_schedulers(trainer, index)


def _step_schedulers(trainer: Any, index: int) -> None:
    """``_TrainingEpochLoop._update_learning_rates("step")`` for the others' batch ``index``."""
    loop = trainer.fit_loop.epoch_loop
    for config in trainer.lr_scheduler_configs:
        if config.interval == "step" and not config.reduce_on_plateau and (index + 1) % config.frequency == 0:
            loop.scheduler_progress.increment_ready()
            call._call_lightning_module_hook(trainer, "lr_scheduler_step", config.scheduler, None)
            loop.scheduler_progress.increment_completed()


class _LoopShadow(Joinable):
    """The second joinable (after the model, whose hook runs the shadow step): Lightning's loop around it."""

    def __init__(self, trainer: Any, model: torch.nn.Module) -> None:
        super().__init__()
        self.trainer, self.model = trainer, model
        self.validates = False  # set when this rank leaves after its last batch

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return _LoopHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.model.join_device

    @property
    def join_process_group(self) -> Any:
        return self.model.join_process_group


class _LoopHook(JoinHook):
    def __init__(self, loop: _LoopShadow) -> None:
        self.loop, self.trainer, self.state = loop, loop.trainer, state_of(loop.model)
        self.shadowed = 0  # batches shadowed so far in this epoch

    def main_hook(self) -> None:
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.ready  # this rank's real batches
        _count_shadow_batch(self.trainer, done + self.shadowed, self.state.shadow_stepped)
        self.shadowed += 1
        _per_batch_collectives(self.trainer)

    def post_hook(self, is_last_joiner: bool) -> None:
        _agree_on_validation(self.trainer, self.loop.validates, is_last_joiner, self.loop.join_device)
