"""transformers ``Trainer`` (and its subclasses: TRL's ``SFTTrainer``...) on fsdp_plugin's engine.

The one-line change in a training script::

    import fsdp_plugin.integrations.transformers  # noqa: F401  (before the Trainer is created)

Then configure FSDP the way transformers and accelerate document it: ``TrainingArguments(fsdp=True,
fsdp_config={...})`` under ``torchrun``/``accelerate launch``, or an accelerate config file with
``distributed_type: FSDP`` under ``accelerate launch``. The import patches ``transformers.Trainer`` (the
class, so every subclass inherits it) to build fsdp_plugin's ``Accelerator`` and to save/load model and
optimizer in fsdp_plugin's sharded format. Without an FSDP selection the Trainer behaves exactly as stock.
``uninstall()`` restores the stock Trainer.
"""
from __future__ import annotations

from ._checkpoint import CHECKPOINT_DIR
from ._install import install, is_installed, uninstall

__all__ = ["CHECKPOINT_DIR", "install", "is_installed", "uninstall"]

install()
