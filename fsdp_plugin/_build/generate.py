"""``model.generate()`` on a sharded model, called as on one GPU: every rank runs the same number of forwards.

Each decoding step's forward all-gathers every unit, so a rank that stops early (its own ``max_new_tokens``, an
EOS, a shorter prompt) must keep running forwards until every rank has stopped, or the ranks' collectives stop
pairing. transformers does exactly that with ``generate(synced_gpus=True)`` (a finished rank runs forwards and
discards them; its tokens, and a sampling rank's random stream, are what one process would produce), and
turns it on by itself for DeepSpeed ZeRO-3 and for modules it detects as torch FSDP-managed
(``transformers.integrations.fsdp.is_fsdp_managed_module``). Our modules are not torch FSDP modules (marking
them so would also change how dynamo traces them), so the engine does the equivalent: the ``generate`` of
every transformers model inside a sharded model defaults ``synced_gpus`` to True when the model's forward
communicates. An explicit ``synced_gpus=`` is passed through untouched.

The whole ``generate`` call also runs inside the root unit's forward (as ``fp.register_forward_method`` does),
under no_grad: the root's parameters (embeddings, head) are gathered once for all decoding steps, and a
``generate`` reached without the root's forward (PEFT's ``PeftModel.generate`` calls the inner model's) still
sees them gathered.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


def _is_generation_model(module: nn.Module) -> bool:
    """transformers' ``GenerationMixin`` is in the class's MRO (transformers is never imported here)."""
    return any(c.__name__ == "GenerationMixin" and c.__module__.startswith("transformers.")
               for c in type(module).__mro__)


def install_synced_generate(model: nn.Module, root) -> int:
    """Default ``synced_gpus=True`` for every transformers model in ``model`` when its sharded forward issues
    collectives, each call inside the root unit's forward. Returns the number of models patched."""
    if root.mesh.world_size == 1:
        return 0
    patched = 0
    for module in model.modules():
        if _is_generation_model(module) and "generate" not in module.__dict__:
            module.generate = _synced(module.generate, root.root_unit)
            patched += 1
    return patched


def _synced(generate, root_unit=None):
    @functools.wraps(generate)
    def synced_generate(*args, **kwargs):
        if kwargs.get("synced_gpus") is None:
            kwargs["synced_gpus"] = True
        if root_unit is None:
            return generate(*args, **kwargs)
        with torch.no_grad():
            args, kwargs = root_unit.pre_forward(args, kwargs)
            try:
                out = generate(*args, **kwargs)
            except BaseException:
                root_unit.post_forward(None)     # reshards: the forward raised
                raise
            return root_unit.post_forward(out)

    synced_generate.__fsdp_plugin__ = True
    return synced_generate
