"""A unit: one wrapped module, its flat handles, and the hooks that schedule unshard/reshard/reduce."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from .._comm.pairing import Entering
from .._flat.flat_param import FlatParamHandle
from .states import ShardedState, TrainingState

if TYPE_CHECKING:
    from .protocols import UnitRoot


class Unit:
    """Runtime state of one FSDP unit; ``state`` (a `TrainingState`) moves only here.

    Invariant: outside a unit's forward/backward every handle is sharded and every site registers the
    original ``nn.Parameter``; while unsharded, sites register full-shape views of the handle's leaf.

    ``some_ranks`` (``ShardingConfig.some_ranks_modules``): the unit's forward may run on some ranks only, so
    it issues no collective of its own: the root gathers it on every rank in its pre-forward (a default-chosen
    encoder only on steps where some rank's inputs hold its modality: ``on_demand.py``), it stays unsharded to
    the end of backward, and its gradient is reduced there (``_reduce/usage.py``).
    """

    def __init__(self, fqn: str, module: nn.Module, handles: list[FlatParamHandle], root: "UnitRoot",
                 reshard_policy: bool, some_ranks: bool = False):
        self.fqn, self.module, self.handles, self.root = fqn, module, handles, root
        self.some_ranks = some_ranks
        # The config's rule for this unit (`UnitPolicy`); the decision after forward is the root's reshard_table.
        # Frozen handles follow the rule: freed once backward passed the unit's inputs (``_hook_inputs``).
        self.reshard_policy = reshard_policy
        self.state = TrainingState.IDLE
        self.depth = 0        # nesting of forward calls (methods calling forward, recomputation in backward)
        self._frozen = [h for h in handles if not h.requires_grad]
        self._views_on: set[int] = set()      # ids of handles whose views are registered
        module.register_forward_pre_hook(self._nn_pre_forward, with_kwargs=True)
        module.register_forward_hook(self._nn_post_forward, always_call=True)  # also after an exception
        for h in handles:
            if h.requires_grad:
                h.leaf.register_post_accumulate_grad_hook(self._make_post_backward(h))

    def __repr__(self):
        return f"Unit({self.fqn or '<root>'}, {sum(h.total for h in self.handles)} params)"

    @property
    def name(self) -> str:
        return self.fqn or "<root>"

    @property
    def in_backward(self) -> bool:
        return self.state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)

    # ------------------------------------------------------------ state moves
    def unshard(self, async_op: bool = True, prompt: bool = False) -> None:
        """Start all-gathering every handle, each all-gather announced (pairing check) as it is issued;
        ``prompt``: the caller waits for them right away (``pairing.Gate``: no completion callback)."""
        backward = self.root.in_backward     # only then may hpZ's secondary slices be used (``_flat/secondary``)
        for i, h in enumerate(self.handles):
            gate = self.root.gate(Entering.ALL_GATHER, self, prompt, i) if h.unshard_communicates else None
            h.unshard(async_op, gate, use_secondary=backward)

    def wait_and_use_views(self) -> None:
        for h in self.handles:
            h.wait_unshard()
            self._register(h, h.views())
            self._views_on.add(id(h))

    def reshard(self, keep_secondary: bool = False) -> None:
        for h in self.handles:
            self._reshard_handle(h, keep_secondary)

    def _reshard_handle(self, h: FlatParamHandle, keep_secondary: bool = False) -> None:
        h.reshard(keep_secondary)
        if id(h) in self._views_on:
            self._register(h, [s.param for s in h.slots])
            self._views_on.discard(id(h))

    @staticmethod
    def _register(h: FlatParamHandle, tensors) -> None:
        for slot, t in zip(h.slots, tensors):
            for _, module, attr in slot.sites:
                module._parameters[attr] = t

    def show_full(self, h: FlatParamHandle, full: torch.Tensor) -> None:
        """Sites of ``h`` register new full-shape parameters viewing ``full`` (fp.full_params)."""
        if h.packed:      # the parameters' own class (Params4bit with its quant_state), as forward sees them
            return self._register(h, h.as_original_class(h.split_full(full)))
        self._register(h, [nn.Parameter(v, requires_grad=s.param.requires_grad)
                           for v, s in zip(h.as_parallel(h.split_full(full)), h.slots)])

    def show_originals(self, h: FlatParamHandle) -> None:
        """Sites of ``h`` register the original (sharded) parameters again."""
        self._register(h, [s.param for s in h.slots])

    def end_backward(self) -> None:
        """Any state -> IDLE, every handle resharded, hpZ slices dropped (end of backward, or an abandoned step)."""
        self.reshard()
        for h in self.handles:
            h.drop_secondary()
        self.state = TrainingState.IDLE
        self.depth = 0

    # ------------------------------------------------------------------ hooks
    def _nn_pre_forward(self, module, args, kwargs):
        return self.pre_forward(args, kwargs)

    def _nn_post_forward(self, module, args, output):
        return self.post_forward(output)

    def pre_forward(self, args, kwargs):
        self.depth += 1
        if self.depth > 1:
            return args, kwargs
        if not self.in_backward:       # recomputation in backward keeps the backward state
            self.state = TrainingState.FORWARD
        args, kwargs = self.root.before_unit_forward(self, args, kwargs)
        self.unshard(prompt=True)
        self.wait_and_use_views()
        self.root.after_unshard_in_forward(self)
        if self._frozen and torch.is_grad_enabled() and self.reshard_policy:
            args, kwargs = self._hook_inputs(args, kwargs)
        return args, kwargs

    def _hook_inputs(self, args, kwargs):
        """Frozen handles have no gradient hook: free them once backward has passed the unit's inputs."""
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not flat:
            return args, kwargs
        outs = _InputsBackward.apply(self, *flat)
        mapping = dict(zip(map(id, flat), outs if isinstance(outs, tuple) else (outs,)))
        return tree_map(lambda t: mapping.get(id(t), t) if isinstance(t, torch.Tensor) else t, (args, kwargs))

    def on_inputs_backward(self) -> None:
        self.state = TrainingState.POST_BACKWARD
        self._maybe_free_frozen()

    def _maybe_free_frozen(self) -> None:
        trainable_busy = any(h.state is ShardedState.UNSHARDED and h.requires_grad and not h._aliases_shard
                             for h in self.handles)
        if self.state is TrainingState.POST_BACKWARD and not trainable_busy:
            for h in self._frozen:
                self._reshard_handle(h)

    def post_forward(self, output):
        self.depth -= 1
        if output is None and sys.exc_info()[1] is not None:
            if self.root.in_backward:
                # Recomputation under activation checkpointing stopped early: torch's early stop raises inside
                # the forward once the saved tensors it needs exist, and those alias this unit's full buffer.
                # The backward in progress owns the parameters; its end reshards them.
                return output
            # The forward raised (this hook is always called): no backward will come for it.
            self.reshard()
            self.state = TrainingState.IDLE
            self.root.after_unit_forward(self, raised=True)
            return output
        if self.depth > 0 or self.root.in_backward:
            # Nested call, or recomputation under activation checkpointing: backward needs the views.
            return output
        self.state = TrainingState.IDLE
        grad_on = torch.is_grad_enabled()
        if grad_on:
            self._register_pre_backward(output)
        if not self.some_ranks and (not grad_on or self.root.reshards_after_forward(self)):
            self.reshard(keep_secondary=grad_on)
        self.root.after_unit_forward(self)
        return output

    def _register_pre_backward(self, output) -> None:
        for t in tree_flatten(output)[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._pre_backward)

    def _pre_backward(self, grad):
        self.root.on_backward_hook()
        if not self.in_backward:
            self.state = TrainingState.PRE_BACKWARD
            self.unshard(prompt=True)
            with torch.enable_grad():  # backward hooks run in no-grad mode; activation-checkpoint recomputation
                self.wait_and_use_views()  # of a non-unit submodule reads these views and needs them connected
            self.root.prefetch_backward(self)
        return grad

    def _make_post_backward(self, h: FlatParamHandle):
        def post_backward(_leaf):
            self.root.on_backward_hook()
            self.root.reduction.grad_ready(h, self)
            if not self.some_ranks:     # it may run again in this step (recomputation): the end of backward frees it
                self._reshard_handle(h)
                self._maybe_free_frozen()
        return post_backward


class _InputsBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward tells the unit that its own backward is done."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = unit
        return tensors[0].view_as(tensors[0]) if len(tensors) == 1 else tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.unit.on_inputs_backward()
        return (None, *grads)
