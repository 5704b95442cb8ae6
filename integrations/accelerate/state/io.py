"""``save_state`` / ``load_state`` for sharded models, in fsdp_plugin's format and without pickle.

Layout of a state directory::

    model_{i}/                    fp.save_checkpoint(model_i, its optimizer): sharded safetensors + manifest
    full_model_{i}/               FULL_STATE_DICT only: the full weights as HF safetensors (not read back)
    accelerator_state.json/.safetensors   rank 0: step, schedulers, dataloaders, scaler, custom objects
    rng_{rank}.json/.safetensors  every rank: python/numpy/torch(/cuda) RNG states

Models and optimizers load at any process count (the engine reshards); RNG states restore the
entry of the same rank when it exists.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .blob import blob_exists, read_blob, write_blob
from .rng import capture_rng, restore_rng
from fsdp_plugin.checkpoint import storage
from fsdp_plugin.errors import ConfigError
from fsdp_plugin.checkpoint.errors import CheckpointNotFoundError, CheckpointStateError, StateMismatchError

STATE_NAME = "accelerator_state"
FORMAT = "fsdp_plugin.accelerate/1"


def model_dir(directory: str, index: int) -> str:
    """Where model ``index`` (and its optimizer) live."""
    return storage.join(directory, f"model_{index}")


def optimizer_for(model: torch.nn.Module, optimizers: list) -> Any:
    """The (unwrapped) optimizers whose parameters belong to ``model``, in prepare order: None, one, or a list
    (e.g. ``fp.optim.Muon`` + AdamW; one ``fp.save_checkpoint`` stores them all)."""
    params = {id(p) for p in model.parameters()}
    found = [_inner(o) for o in optimizers if any(id(p) in params for g in _inner(o).param_groups for p in g["params"])]
    return None if not found else found[0] if len(found) == 1 else found


def _inner(optimizer: Any) -> Any:
    """Strip accelerate's ``AcceleratedOptimizer``."""
    return getattr(optimizer, "optimizer", optimizer)


def check_optimizers(models: list, optimizers: list) -> None:
    """Every prepared optimizer must belong to a prepared model (its state is saved with that model)."""
    owned = set()
    for m in models:
        mine = optimizer_for(m, optimizers)
        owned.update(id(o) for o in (mine if isinstance(mine, list) else [mine] if mine is not None else []))
    orphans = [type(_inner(o)).__name__ for o in optimizers if id(_inner(o)) not in owned]
    if orphans:
        raise ConfigError(f"save_state/load_state: optimizer(s) {orphans} hold no parameter of a prepared model; "
                         "prepare the model they optimize with the same Accelerator")


def save_models(directory: str, models: list, optimizers: list, async_save=False):
    """Collective: one sharded checkpoint per model, with its optimizer.

    Returns the last save's ``fp.AsyncSave`` handle when ``async_save`` (each save waits for the previous).
    """
    from fsdp_plugin.checkpoint import save_checkpoint

    check_optimizers(models, optimizers)
    handle = None
    for i, model in enumerate(models):
        handle = save_checkpoint(model_dir(directory, i), model, optimizer_for(model, optimizers),
                                 async_save=async_save)
    return handle


def full_model_dir(directory: str, index: int) -> str:
    """Where ``fsdp_state_dict_type: FULL_STATE_DICT`` puts model ``index``'s full weights."""
    return storage.join(directory, f"full_model_{index}")


def save_full_models(directory: str, models: list) -> None:
    """Collective: each model's full weights as Hugging Face safetensors (``fp.save_pretrained``), what
    stock accelerate's FULL_STATE_DICT gives (one consolidated model file), readable without fsdp_plugin."""
    from fsdp_plugin.checkpoint import save_pretrained

    for i, model in enumerate(models):
        save_pretrained(model, full_model_dir(directory, i))


def load_models(directory: str, models: list, optimizers: list) -> None:
    """Collective: inverse of :func:`save_models`, at any process count."""
    from fsdp_plugin.checkpoint import load_checkpoint

    check_optimizers(models, optimizers)
    for i, model in enumerate(models):
        path = model_dir(directory, i)
        if not storage.storage_for(path).isdir(path):
            raise CheckpointNotFoundError(f"load_state: {path} is missing (the state has fewer models than were "
                                          "prepared)")
        load_checkpoint(path, model, optimizer_for(model, optimizers))


def accelerator_state(acc: Any) -> dict[str, Any]:
    """Everything besides models/optimizers/RNG that accelerate's save_state stores."""
    return {
        "format": FORMAT, "step": int(acc.step), "num_processes": int(acc.num_processes),
        "schedulers": [s.state_dict() for s in acc._schedulers],
        "dataloaders": [dataloader_state(dl) for dl in acc._dataloaders],
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
        "custom": [obj.state_dict() for obj in acc._custom_objects],
    }


def dataloader_state(dl: Any) -> dict[str, Any]:
    """Epoch/iteration counters, seedable sampler state and a stateful dataloader's own state."""
    state: dict[str, Any] = {"iteration": getattr(dl, "iteration", None)}
    sampler = _seedable_sampler(dl)
    if sampler is not None:
        state["sampler"] = {"epoch": int(sampler.epoch), "initial_seed": int(sampler.initial_seed)}
    if getattr(dl, "use_stateful_dataloader", False):
        state["stateful"] = dl.state_dict()
    return state


def _seedable_sampler(dl: Any) -> Any:
    """accelerate's ``SeedableRandomSampler`` behind ``dl``, if any."""
    get = getattr(dl, "get_sampler", None)
    sampler = get() if callable(get) else None
    return sampler if sampler is not None and hasattr(sampler, "initial_seed") and hasattr(sampler, "epoch") else None


def restore_dataloader(dl: Any, state: dict[str, Any]) -> None:
    """Inverse of :func:`dataloader_state`."""
    if state.get("iteration") is not None and hasattr(dl, "iteration"):
        dl.iteration = state["iteration"]
    sampler = _seedable_sampler(dl)
    if sampler is not None and "sampler" in state:
        sampler.epoch = state["sampler"]["epoch"]
        sampler.initial_seed = state["sampler"]["initial_seed"]
    if "stateful" in state and getattr(dl, "use_stateful_dataloader", False):
        dl.load_state_dict(state["stateful"])


def save_small_state(directory: str, acc: Any) -> None:
    """Rank 0 writes the accelerator state; every rank writes its RNG state."""
    if acc.is_main_process:
        write_blob(directory, STATE_NAME, accelerator_state(acc))
    write_blob(directory, f"rng_{acc.process_index}", capture_rng())


def load_small_state(directory: str, acc: Any) -> None:
    """Inverse of :func:`save_small_state`; checks the saved objects match the prepared ones."""
    state = read_blob(directory, STATE_NAME)
    if state.get("format") != FORMAT:
        raise CheckpointStateError(f"load_state: {directory} was not written by fsdp_plugin's Accelerator.save_state")
    _check_counts(directory, state, acc)
    for sched, sd in zip(acc._schedulers, state["schedulers"]):
        sched.load_state_dict(sd)
    for dl, sd in zip(acc._dataloaders, state["dataloaders"]):
        restore_dataloader(dl, sd)
    if acc.scaler is not None and state["scaler"] is not None:
        acc.scaler.load_state_dict(state["scaler"])
    for obj, sd in zip(acc._custom_objects, state["custom"]):
        obj.load_state_dict(sd)
    acc.step = state["step"]
    _load_rng(directory, acc.process_index)


def _check_counts(directory: str, state: dict, acc: Any) -> None:
    """Fail naming what differs between the saved state and the prepared objects."""
    for what, saved, now in (("schedulers", state["schedulers"], acc._schedulers),
                             ("registered custom objects", state["custom"], acc._custom_objects)):
        if len(saved) != len(now):
            raise StateMismatchError(f"load_state: {directory} holds {len(saved)} {what} but {len(now)} are "
                               "prepared/registered; prepare and register the same objects as when saving")


def _load_rng(directory: str, rank: int) -> None:
    """Restore this rank's RNG states, or warn when the state was saved with fewer processes."""
    name = f"rng_{rank}"
    if blob_exists(directory, name):
        restore_rng(read_blob(directory, name))
    else:
        warnings.warn(f"load_state: no RNG state for process {rank} in {directory} (saved with fewer "
                      "processes); this process keeps its current RNG state", stacklevel=3)
