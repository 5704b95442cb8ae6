"""``fp.optim.MuonWithAdamW``: Muon for the hidden matrices and AdamW for the rest, as *one* torch optimizer.

Frameworks that take a single optimizer (the transformers ``Trainer``: ``optimizers=(opt, sched)`` or a
``create_optimizer`` override) need the usual Muon recipe in one object. The parameter groups say which
optimizer each group belongs to (``use_muon``, as in Keller Jordan's ``MuonWithAuxAdam``); every other
key is a hyper-parameter of that optimizer, defaults as ``fp.optim.Muon`` / ``torch.optim.AdamW``.

Invariants: ``param_groups`` is the user's list of group dicts, in the user's order, and the inner
``fp.optim.Muon`` and stock ``torch.optim.AdamW`` hold *the same dict objects* (a learning-rate scheduler
or a checkpoint load that writes a group's ``lr`` reaches the optimizer that uses it) and share one
``state`` mapping (parameters are disjoint). A step is exactly ``muon.step(); adamw.step()``; state dicts
are torch's generic ones, so checkpoints (``fp.save_checkpoint``, the Trainer's) hold both parts.
"""
from __future__ import annotations

import torch

from ..errors import OptimizerError
from ._checks import check_params
from .muon import Muon

_HELP = ("give every parameter group a 'use_muon' key: True for the hidden 2-D matrices (and expert stacks), "
         "False for embeddings, the output head, norms, biases and scalars (README, 'Matrix optimizers')")


class MuonWithAdamW(torch.optim.Optimizer):
    """``fp.optim.Muon`` on the groups with ``use_muon=True``, ``torch.optim.AdamW`` on those with ``False``.

    Example: ``MuonWithAdamW([{"params": hidden, "use_muon": True, "lr": 0.02},
    {"params": rest, "use_muon": False, "lr": 3e-4, "betas": (0.9, 0.95)}])``. Built before or after
    ``fp.shard``, on every rank with the same groups; unsharded it is Muon + AdamW on full tensors.
    """

    _fp_sharding_aware = True    # the per-tensor guard lets it through (its Muon part is fp.optim.Muon)

    def __init__(self, param_groups) -> None:
        groups = list(param_groups)
        if not groups or not all(isinstance(g, dict) for g in groups):
            raise OptimizerError(f"fp.optim.MuonWithAdamW takes a list of parameter-group dicts: {_HELP}")
        self._parts: dict[bool, torch.optim.Optimizer] = {}
        super().__init__(groups, {})

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to this optimizer and to the part (Muon or AdamW) its ``use_muon`` names."""
        if not isinstance(param_group.get("use_muon"), bool):
            raise OptimizerError(f"fp.optim.MuonWithAdamW got a parameter group without a boolean 'use_muon' "
                                 f"(keys {sorted(param_group)}): {_HELP}")
        super().add_param_group(param_group)     # duplicate checks across all groups; keeps the dict object
        kind = param_group["use_muon"]
        part = self._parts.get(kind)
        if part is None:
            part = Muon([param_group]) if kind else torch.optim.AdamW([param_group])
            self._parts[kind] = part
        else:
            part.add_param_group(param_group)
            if kind:
                check_params([param_group])
        part.state = self.state

    @property
    def muon(self) -> Muon | None:
        """The Muon part (None when no group has ``use_muon=True``)."""
        return self._parts.get(True)

    @property
    def adamw(self) -> torch.optim.AdamW | None:
        """The AdamW part (None when no group has ``use_muon=False``)."""
        return self._parts.get(False)

    @torch.no_grad()
    def step(self, closure=None):
        """Muon's step, then AdamW's (each on its own groups); ``closure`` is evaluated once."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for kind in (True, False):
            if kind in self._parts:
                self._parts[kind].step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load (it builds new group dicts and a new state mapping), then re-point both parts at them."""
        super().load_state_dict(state_dict)
        for kind, part in self._parts.items():
            part.param_groups = [g for g in self.param_groups if g["use_muon"] is kind]
            part.state = self.state
