"""``load_state`` of a directory written by stock accelerate with FSDP ``SHARDED_STATE_DICT``.

Layout (accelerate 1.x, ``fsdp_utils.save_fsdp_model/optimizer``, ``checkpointing.save_accelerator_state``)::

    pytorch_model_fsdp_{i}/    torch DCP of {"model": state dict}
    optimizer_{i}/             torch DCP of {"optimizer": optimizer state dict (FQN-keyed)}
    scheduler.bin, scheduler_{i}.bin, random_states_{rank}.pkl, ...   torch.save pickles

Models and optimizers go through the DCP reader (each rank reads its byte ranges, any process count).
Side files are read with ``weights_only=True`` (accelerate's own loader, numpy RNG arrays allowed);
samplers, dataloader states and custom objects (pickled objects) are not restored: a warning names them.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

from fsdp_plugin.checkpoint.dcp import is_dcp_dir, load_dcp

MODEL_DIR, OPTIM_DIR = "pytorch_model_fsdp_{}", "optimizer_{}"


def is_stock_sharded(directory: str) -> bool:
    """Whether ``directory`` is a stock accelerate ``SHARDED_STATE_DICT`` save_state directory."""
    return is_dcp_dir(os.path.join(directory, MODEL_DIR.format(0)))


def load_stock(directory: str, acc: Any, models: list, optimizers: list) -> None:
    """Collective: models (+ their optimizers) from the DCP dirs, then schedulers, step and RNG."""
    from .io import check_optimizers, optimizer_for

    check_optimizers(models, optimizers)
    for i, model in enumerate(models):
        opt = optimizer_for(model, optimizers)
        opt_dir = os.path.join(directory, OPTIM_DIR.format(i))
        load_dcp(os.path.join(directory, MODEL_DIR.format(i)), model, opt,
                 optimizer_path=opt_dir if opt is not None and is_dcp_dir(opt_dir) else None)
    _load_side_files(directory, acc)


def _load_side_files(directory: str, acc: Any) -> None:
    from accelerate.utils.other import (
        load,  # weights_only=True with accelerate's numpy allow-list
    )

    for i, sched in enumerate(acc._schedulers):
        path = os.path.join(directory, "scheduler.bin" if i == 0 else f"scheduler_{i}.bin")
        if os.path.isfile(path):
            sched.load_state_dict(load(path, map_location="cpu"))
    rng = os.path.join(directory, f"random_states_{acc.process_index}.pkl")
    if os.path.isfile(rng):
        _restore_rng(load(rng, map_location="cpu"), acc)
    elif os.path.isfile(first := os.path.join(directory, "random_states_0.pkl")):  # saved with fewer processes
        acc.step = int(load(first, map_location="cpu").get("step", acc.step))
        warnings.warn(f"load_state: no RNG state for process {acc.process_index} in {directory} (saved with fewer "
                      "processes); this process keeps its current RNG state", stacklevel=3)
    skipped = sorted(n for n in os.listdir(directory)
                     if n.startswith(("sampler", "dl_state_dict", "custom_checkpoint")) or n == "scaler.pt")
    if skipped:
        warnings.warn(f"load_state({directory}): {', '.join(skipped)} (pickled objects) are not restored from a "
                      "stock accelerate directory; recreate them, or resume the dataloader with skip_first_batches",
                      stacklevel=3)


def _restore_rng(states: dict, acc: Any) -> None:
    import random

    import numpy as np
    import torch

    if "step" in states:
        acc.step = int(states["step"])
    random.setstate(states["random_state"])
    np.random.set_state(states["numpy_random_seed"])
    torch.set_rng_state(states["torch_manual_seed"])
    if torch.cuda.is_available() and "torch_cuda_manual_seed" in states:
        torch.cuda.set_rng_state_all(states["torch_cuda_manual_seed"])
