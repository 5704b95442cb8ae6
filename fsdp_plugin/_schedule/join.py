"""Uneven inputs: a sharded model is a joinable of torch's ``Join`` (``torch.distributed.algorithms.join``).

    with Join([model], divide_by_initial_world_size=True):
        for x, y in my_batches:          # ranks may have different numbers of batches
            loss_fn(model(x), y).backward(); fp.clip_grad_norm_(model, 1.0); opt.step(); opt.zero_grad()

A rank out of batches *joins*: for every step the others still run, ``Join`` calls our hook, which shadows
that step. Unlike DDP (whose joined ranks only add zero buckets and are overwritten at the end), a ZeRO-3
rank is the only owner of its shard: it must serve its current shard to every all-gather and apply the
optimizer step to it. So the hook replays the rank's last real step with a zero loss: the model's forward
on the last input (same units, all-gathers in the same order), ``backward`` of ``0 * outputs`` (the same
reduce-scatters and unused-parameter agreement, adding zeros), then what the rank's last real step did
after backward: ``fp.clip_grad_norm_`` with the same arguments, each optimizer that stepped sharded
parameters (its hyper-parameters taken from the non-joined ranks by a MAX all-reduce, so learning-rate
schedules keep going), ``zero_grad``. Model buffers are restored after the shadow forward.

Per step while a Join context is enabled, every rank issues one 3-element all-reduce ``[active, reducing,
stepping]`` at the root's forward (the number of ranks still training; how many reduce gradients, i.e. not
``no_sync``; how many will step the optimizers after this backward: all reducing ones unless an integration
marks the micro-batch ``accumulating``, as Lightning's ``accumulate_grad_batches`` does) and, while some rank
has joined, one small MAX all-reduce per optimizer step. Active ranks that disagree about reducing or stepping
(a partial last accumulation window on one rank) get a UsageError on every rank, not a hang. The shadow
replays the entry point of the last real step: ``model(...)``, or the method registered with
``fp.register_forward_method`` (Lightning's ``training_step``).
``divide_by_initial_world_size=False`` averages gradients over the active ranks instead of the world (DDP's
rule). Contract: every step of the loop does the same thing after backward (clip every step or never, the
same optimizers); no evaluation forward and no other collective inside the context (the joined ranks
would not shadow it; use ``throw_on_early_termination=True`` to stop at the first exhausted rank instead).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig
from torch.utils._pytree import tree_flatten

from .._comm import collectives as comm
from .states import ReduceWindow
from ..errors import UsageError

_ACTIVE: list = []          # JoinStates of models inside an enabled Join context on this rank
_HOOKS_INSTALLED = False


class JoinState:
    """Per sharded model: what the last real step did, for the shadow steps of a joined rank."""

    def __init__(self, model: torch.nn.Module, root):
        self.model_ref, self.root = _weak(model), root
        self.handle_ids = {id(h) for u in root.units for h in u.handles}
        self.divide_by_world = True
        self.shadowing = False
        self.n_active = root.mesh.world_size
        self.last_input: Optional[tuple] = None
        self.clip: Optional[tuple] = None           # (fp.clip_grad_norm_, max_norm, norm_type) of the last real step
        self.optimizers: list = []                  # optimizers that stepped sharded params in the last step
        self._this_step: list = []
        self._clip_this_step: Optional[tuple] = None
        self._reducing = False                      # the current real step reduces gradients (not no_sync)
        self._stepping = False                      # ... and its optimizers step after backward
        self._stepped = False                       # this rank's previous step ran the optimizers
        self.entry = "__call__"                     # set by a registered forward method before its root forward
        self.accumulating = False                   # set by integrations: this micro-batch reduces, no optimizer step

    # -------------------------------------------------------------- every rank
    def before_forward(self, args, kwargs) -> None:
        """Root forward with grad enabled inside an enabled Join: count the active ranks (the joined ones
        answer from the hook) and remember the input; the finished step's record becomes the script."""
        model, entry, self.entry = self.model_ref(), self.entry, "__call__"
        if self.shadowing or not torch.is_grad_enabled() or model is None or not model._join_config.enable:
            return
        if self not in _ACTIVE:
            _ACTIVE.append(self)
        Join.notify_join_context(model)
        self._promote()
        self.last_input, self._stepped = (args, kwargs, entry), False
        reducing = 0 if self.root.reduction.no_sync else 1
        self._reducing, self._stepping = self._count(1, reducing, reducing and not self.accumulating)

    def _promote(self) -> None:
        """The last real step is complete: if it stepped the optimizers, what it did after backward is the
        script (an accumulation micro-batch only reduces)."""
        if self._stepping:
            self.optimizers, self.clip = list(self._this_step), self._clip_this_step
        self._this_step, self._clip_this_step, self._reducing, self._stepping = [], None, False, False

    def _count(self, active: int, reducing: int, stepping: int) -> tuple:
        """The 3-element all-reduce of every step: sets n_active and the gradient divisor; returns whether
        the active ranks reduce and step (they must agree: UsageError on every rank otherwise)."""
        flags = torch.tensor([active, reducing, int(stepping)], dtype=torch.int64, device=self.root.device)
        comm.all_reduce(flags, None, kind="control", what="Join: counting the ranks that still have inputs",
                        timeout_s=self._timeout())
        self.n_active, reducing, stepping = flags.tolist()
        if reducing not in (0, self.n_active) or stepping not in (0, self.n_active):
            raise UsageError(f"inside Join, {reducing} of {self.n_active} active ranks reduce gradients and "
                             f"{stepping} step the optimizers in this step: every rank must do the same (with "
                             "gradient accumulation, give every rank a number of batches that is a multiple of "
                             "the accumulation, e.g. drop_last=True or limit_train_batches)")
        # context parallel: the ranks of a CP group share their batches, so they count as one (Mesh.reduce_world)
        divisor = None if self.divide_by_world or self.n_active == self.root.mesh.world_size \
            else self.n_active // self.root.mesh.cp_size
        for u in self.root.units:
            for h in u.handles:
                h.grad_divisor = divisor
        return bool(reducing), bool(stepping)

    def _timeout(self) -> Optional[float]:
        hs = [h for u in self.root.units for h in u.handles]
        return hs[0].timeout_s if hs else None

    @property
    def shadow_stepped(self) -> bool:
        """Whether the last shadow step ran the optimizers (integrations count the others' steps by it)."""
        return self._stepped

    def note_optimizer(self, opt) -> None:
        if not self.shadowing and opt not in self._this_step:
            self._this_step.append(opt)
            self._stepped = True

    def note_clip(self, clip, max_norm: float, norm_type: float) -> None:
        if not self.shadowing:
            self._clip_this_step = (clip, max_norm, norm_type)

    def close(self) -> None:
        """Join finished on every rank: back to plain steps."""
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        model = self.model_ref()
        if model is not None:
            model._join_config = _JoinConfig.construct_disabled_join_config()
        self.last_input, self.n_active = None, self.root.mesh.world_size
        for u in self.root.units:
            for h in u.handles:
                h.grad_divisor = None

    # -------------------------------------------------------------- joined rank
    def shadow_step(self) -> None:
        """One step of the others, with a zero loss (see module docstring)."""
        model = self.model_ref()
        if self.last_input is None or model is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise UsageError(f"rank {rank} joined before its first training step inside the Join "
                             "context: every rank needs at least one batch (it replays its last step for the others)")
        self._promote()
        reducing, stepping = self._count(0, 0, 0)
        if self._stepped:                       # a finished window's gradients (a loop that zeroes at its start)
            model.zero_grad(set_to_none=True)
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        self.shadowing, window = True, self.root.reduction.window
        try:
            self.root.reduction.window = ReduceWindow.SYNC if reducing else ReduceWindow.NO_SYNC
            with torch.enable_grad():
                args, kwargs, entry = self.last_input
                call = model if entry == "__call__" else getattr(model, entry)
                zero_loss(call(*args, **kwargs)).backward()
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            if stepping:
                self._after_backward(model)
            self._stepped = stepping
        finally:
            self.shadowing = False
            self.root.reduction.restore_window(window)

    def _after_backward(self, model) -> None:
        if self.clip is not None:       # fp.clip_grad_norm_: this rank's shard of the global norm, same collective
            clip, max_norm, norm_type = self.clip
            clip(model.parameters(), max_norm, norm_type)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad()


def zero_loss(output) -> torch.Tensor:
    """``0 * sum`` of every floating output that needs a gradient: zero gradients through the same graph."""
    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        raise UsageError("the sharded model's output needs no gradient: a joined rank cannot shadow backward")
    return sum(t.float().sum() for t in leaves) * 0.0


class _ShardJoinHook(JoinHook):
    def __init__(self, state: JoinState):
        self.state = state

    def main_hook(self) -> None:
        self.state.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.state.close()


def _join_hook(state: JoinState, **kwargs) -> JoinHook:
    state.divide_by_world = kwargs.get("divide_by_initial_world_size", True)
    return _ShardJoinHook(state)


def make_joinable(model: torch.nn.Module, root) -> None:
    """Give ``model`` what ``Join`` reads (duck typing, no class change): ``_join_config``, ``join_hook``,
    ``join_device``, ``join_process_group`` (None: the default group, every rank; no reference kept)."""
    state = root.join = JoinState(model, root)
    model._join_config = _JoinConfig.construct_disabled_join_config()
    model.join_hook = functools.partial(_join_hook, state)
    model.join_device = comm.device() if dist.is_initialized() else root.device
    model.join_process_group = None
    _install_optimizer_hook()


def _install_optimizer_hook() -> None:
    global _HOOKS_INSTALLED
    if not _HOOKS_INSTALLED:
        _HOOKS_INSTALLED = True
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_before_optimizer_step)
        register_optimizer_step_post_hook(_after_optimizer_step)


def _states_of(opt) -> list:
    ids = {id(getattr(p, "_fp_handle", None)) for g in opt.param_groups for p in g["params"]}
    return [state for state in _ACTIVE if ids & state.handle_ids]


def _before_optimizer_step(opt, args, kwargs) -> None:
    """Global pre-step hook, for the joined ranks' shadow steps: take the others' hyper-parameters before
    stepping. Free when no Join context is active (one list check)."""
    if _ACTIVE:
        for state in _states_of(opt):
            if state.shadowing:
                _sync_hyperparameters(opt, state)


def _after_optimizer_step(opt, args, kwargs) -> None:
    """Global post-step hook, for real steps: record the optimizer and send its hyper-parameters. After the
    step, not before: ``opt.step(closure)`` (Lightning) runs forward and backward inside the step, and the
    MAX all-reduce must come after backward on every rank, where the joined ranks' shadow has it."""
    if _ACTIVE:
        for state in _states_of(opt):
            if not state.shadowing:
                state.note_optimizer(opt)
                if state.n_active < state.root.mesh.world_size:
                    _sync_hyperparameters(opt, state)


def note_clip(clip, max_norm: float, norm_type: float) -> None:
    """Called by fp.clip_grad_norm_ (``clip``, passed in: no import cycle): the joined ranks replay the clip of
    the last real step."""
    for state in _ACTIVE:
        state.note_clip(clip, max_norm, norm_type)


def _numbers(group: dict) -> list:
    """(key, index or None) of every numeric hyper-parameter of a param group, in a fixed order."""
    slots = []
    for k in sorted(k for k in group if k != "params"):
        v = group[k]
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            slots.append((k, None))
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
            slots += [(k, i) for i in range(len(v))]
    return slots


def _sync_hyperparameters(opt, state: JoinState) -> None:
    """MAX all-reduce of the optimizer's numeric hyper-parameters; joined ranks send -inf and take the result
    (bit-exact: a MAX of equal values is that value), so their shard steps with the others' schedule."""
    slots = [(g, k, i) for g in opt.param_groups for k, i in _numbers(g)]
    mine = [-math.inf if state.shadowing else float(g[k] if i is None else g[k][i]) for g, k, i in slots]
    t = torch.tensor(mine, dtype=torch.float64, device=state.root.device)
    comm.all_reduce(t, None, op=dist.ReduceOp.MAX, kind="control", what="Join: optimizer hyper-parameters",
                    timeout_s=state._timeout())
    if not state.shadowing:
        return
    for (g, k, i), v in zip(slots, t.tolist()):
        old = g[k] if i is None else g[k][i]
        v = type(old)(v)
        if i is None:
            g[k] = v
        else:
            seq = list(g[k])
            seq[i] = v
            g[k] = type(g[k])(seq)


def _weak(model):
    import weakref
    return weakref.ref(model)


def state_of(model: torch.nn.Module) -> Optional[JoinState]:
    """The JoinState of a sharded root model, for integrations that run Join themselves (Lightning):
    ``accumulating``, ``shadow_stepped``, ``close()``."""
    root = getattr(model, "_fp_root", None)
    return getattr(root, "join", None)
