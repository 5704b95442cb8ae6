"""``fp.join(model)``: evaluation with different numbers of forwards per rank (torch's ``Join`` covers training).

    with torch.no_grad(), fp.join(model):
        for batch in my_eval_batches:      # ranks may have different numbers of batches (IterableDataset, ...)
            total += loss_fn(model(batch), ...)

Every forward all-gathers the units, so a rank that has run out of batches must keep serving its shards while
the others still run forwards. Inside the block, each root forward of the model first joins a one-element
count (the ranks that still run forwards) on the control group; on leaving the block a rank keeps counting
with 0 and, while the count is above 0, replays its last forward (outputs discarded), whose all-gathers pair
with the others' forward; when the count is 0 every rank has left and all leave together. The values a rank
computes are only its own batches', so per-rank sums reduced after the block equal one process's.

A rank that ran no forward in the block has nothing to replay: pass ``example=`` (the positional arguments as a
tuple, or keyword arguments as a dict, of one forward). Without it every rank raises UsageError at the first
count instead of hanging. Contract: forwards only (no backward: training uses torch's ``Join([model])``), every
forward runs the same units in the same order whatever its input (true of transformers models), and no other
collective inside the block (``generate()``'s own ``synced_gpus`` all-reduce included: generate with uneven
batch counts outside the block, after padding the batch counts).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Union

import torch
from torch import nn

from .._comm import collectives as comm
from ..errors import ShardingError, UsageError


class EvalJoin:
    """Per model while ``fp.join`` is open: the last forward's input and the count (module doc)."""

    def __init__(self, model: nn.Module, root, example) -> None:
        self.model, self.root = model, root
        self.shadowing = False
        self.last: Optional[tuple] = _as_call(example) if example is not None else None
        self.forwards = 0           # forwards this rank ran in the block (its own)
        self.entry = "__call__"     # set by a method registered with fp.register_forward_method before its call
        self.shadowed = 0           # forwards it replayed for the others after leaving

    def before_forward(self, args, kwargs) -> None:
        """A root forward inside the block: join the count as an active rank, remember the input."""
        if self.shadowing:
            return
        if torch.is_grad_enabled():
            raise UsageError("fp.join(model) is for evaluation forwards: run them under torch.no_grad() (or "
                             "torch.inference_mode()); for training with uneven batches use torch's "
                             "Join([model]) (README: Uneven inputs)")
        self._count(active=1, missing=0)
        entry, self.entry = self.entry, "__call__"
        self.last, self.forwards = (args, kwargs, entry), self.forwards + 1

    def finish(self) -> None:
        """Leaving the block: replay the last forward while other ranks still run theirs."""
        while self._count(active=0, missing=int(self.last is None)):
            args, kwargs, entry = self.last
            self.shadowing = True
            try:
                with torch.no_grad():      # the same entry point: forward, or e.g. Lightning's validation_step
                    (self.model if entry == "__call__" else getattr(self.model, entry))(*args, **kwargs)
            finally:
                self.shadowing = False
            self.shadowed += 1

    def _count(self, active: int, missing: int) -> int:
        flags = torch.tensor([active, missing], dtype=torch.int64, device=self.root.device)
        hs = [h for u in self.root.units for h in u.handles]
        comm.all_reduce(flags, None, kind="control", what="fp.join: counting the ranks still running forwards",
                        timeout_s=hs[0].timeout_s if hs else None)
        n_active, n_missing = flags.tolist()
        if n_missing and n_active:
            raise UsageError(f"fp.join: {n_missing} rank(s) left the block without running a forward while "
                             f"{n_active} still run forwards, so they have no input to replay: pass one forward's "
                             "inputs as fp.join(model, example=(args...)) or example={kwargs...}")
        return n_active


def _as_call(example: Union[tuple, dict, torch.Tensor]) -> tuple:
    if isinstance(example, dict):
        return (), dict(example), "__call__"
    if isinstance(example, tuple):
        return example, {}, "__call__"
    return (example,), {}, "__call__"


@contextlib.contextmanager
def join(model: nn.Module, example: Union[tuple, dict, torch.Tensor, None] = None) -> Iterator[EvalJoin]:
    """Evaluation forwards whose number differs per rank (module doc). Collective: every rank of the model's
    process group enters and leaves the block. Yields the per-model state (``forwards``, ``shadowed``)."""
    root = getattr(model, "_fp_root", None)
    if root is None:
        raise ShardingError(f"fp.join: {type(model).__name__} is not sharded: call fp.shard(model) first")
    if root.eval_join is not None:
        raise UsageError("fp.join(model) is already open for this model")
    state = root.eval_join = EvalJoin(model, root, example)
    try:
        yield state
        state.finish()          # not after an exception: the others then fail at their deadline, as without it
    finally:
        root.eval_join = None
