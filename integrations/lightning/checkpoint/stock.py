"""``fit(ckpt_path=...)`` from a checkpoint of Lightning's own ``FSDPStrategy(state_dict_type="sharded")``
(or ``ModelParallelStrategy``): a torch DCP directory of ``{"model" | "state_dict": ..., "optimizer_<i>":
...}`` plus ``meta.pt`` (Lightning's loops, callbacks, schedulers, hparams; a ``torch.save`` pickle).

Model and optimizers go through the DCP reader (each rank reads its byte ranges, any device count);
``meta.pt`` is read with ``torch.load(weights_only=True)`` (tensors and plain containers only).
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fsdp_plugin.checkpoint.dcp import is_dcp_dir, load_dcp
from fsdp_plugin.checkpoint.errors import CheckpointStateError

META = "meta.pt"


def is_stock_sharded(path: Path) -> bool:
    """A directory written by Lightning's FSDPStrategy/ModelParallelStrategy (DCP + ``meta.pt``)."""
    return not isinstance(path, str) and is_dcp_dir(path) and (path / META).is_file()  # a str: a URL


def load_stock(path: Path, model: torch.nn.Module, optimizers: Sequence[Any]) -> dict[str, Any]:
    """Collective: load model (+ optimizers when given) from the DCP; return Lightning's state from ``meta.pt``."""
    opts = [getattr(o, "_optimizer", o) for o in optimizers]
    load_dcp(path, model, opts or None)
    try:
        return torch.load(path / META, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - weights_only refuses an object it does not know
        raise CheckpointStateError(
            f"{path / META} holds objects that torch.load(weights_only=True) refuses ({e}); the weights and "
            "optimizer state are readable, Lightning's loop state is not. Allow-list the classes with "
            "torch.serialization.add_safe_globals([...]) if you trust the file, or load the weights only "
            "(fsdp_plugin.load_checkpoint(path, model)) and start a new fit.") from None
