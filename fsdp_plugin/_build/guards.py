"""Guards against silent misuse of a sharded model: plain state_dict()/load_state_dict() (they would
see shard pieces), optimizers whose state does not match the sharded parameters, and per-tensor optimizers
(Muon, Adafactor, LAMB...) on pieces of tensors, which would compute per-piece statistics: they raise at
their first step, on every rank alike (the decision uses the layout, which every rank knows), never warn —
except torch's Muon and Adafactor and classes marked with ``fp.optim.register_per_tensor``, which get the
exact owner step (``optim/owner_step.py``: the stock step on full tensors)."""
from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch import nn

from .._comm import collectives as comm, failure
from .._experts.spec import ep_spec
from .._flat.dtensor import tp_spec
from .._flat.offload import fast_host_step
from .._flat.layout import param_info
from ..errors import OptimizerError, StateDictError
from ..optim import owner_step

_STATE_DICT_HELP = ("on a sharded model outside `with fp.full_params(model):` it would hold shard pieces (whole rows); "
                    "use fp.full_state_dict(model) (full tensors on rank 0), fp.save_checkpoint/fp.load_checkpoint "
                    "(sharded, any world size), or call it inside `with fp.full_params(model):`")
# Optimizers whose update of a parameter depends on more than its own elements (norms, factored
# moments, orthogonalization, line searches): on shard pieces they compute per-piece statistics instead.
# By class name: the libraries need not be imported (registered classes and torch's own run the owner step).
PER_TENSOR = {"LAMB", "Lamb", "FusedLAMB", "Adafactor", "LARS", "LBFGS", "Shampoo", "DistributedShampoo", "SOAP",
              "Muon", "SophiaG", "Dion"}
_checked_optimizers: "weakref.WeakSet" = weakref.WeakSet()
# the checked ones that run the owner step (decided once, at their first step): a set lookup per step after that
_owner_optimizers: "weakref.WeakSet" = weakref.WeakSet()
_hook_handle = None
# optimizers over cpu_offload parameters -> their models' HostCopiers (``_flat/offload.py``): each step first waits
# for copies still reading the master shards (none after a backward: that wait was the backward's own)
_offloaded: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def install_guards(model: nn.Module, root) -> None:
    plain_state_dict, plain_load = model.state_dict, model.load_state_dict

    peft_help = _peft_help(model)

    def state_dict(*args, **kwargs):
        if not root.full_params_active:
            raise StateDictError(f"{type(model).__name__}.state_dict(): {_STATE_DICT_HELP}{peft_help}")
        return plain_state_dict(*args, **kwargs)

    def load_state_dict(*args, **kwargs):
        if not root.full_params_active:
            raise StateDictError(f"{type(model).__name__}.load_state_dict(): {_STATE_DICT_HELP}")
        return plain_load(*args, **kwargs)

    model.state_dict = state_dict
    model.load_state_dict = load_state_dict
    _install_optimizer_check()


def _peft_help(model: nn.Module) -> str:
    """PEFT reads adapters through ``state_dict()`` (``get_peft_model_state_dict``): name its two working forms."""
    if not any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__):
        return ""
    return (". PEFT adapters: model.save_pretrained(dir) writes them (collective, no gather); "
            "peft.get_peft_model_state_dict(model) works inside `with fp.full_params(model):`")


def _install_optimizer_check() -> None:
    global _hook_handle
    if _hook_handle is None:
        _hook_handle = (register_optimizer_step_pre_hook(_check_optimizer),
                        register_optimizer_step_post_hook(_after_step))


def _check_optimizer(optimizer, args, kwargs) -> None:
    # a collective failed by the deadline monitor poisons the process: no step, ever (``_comm/failure.py``)
    failure.refuse(f"{type(optimizer).__name__}.step()")
    comm.MONITOR.check()
    if optimizer in _checked_optimizers:
        for copier in _offloaded.get(optimizer, ()):
            copier.before_host_update()
        if optimizer in _owner_optimizers:
            owner_step.before(optimizer)
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    stale = next((p for p in params if getattr(p, "_fp_replaced", False)), None)
    if stale is not None:
        raise OptimizerError(
            f"{type(optimizer).__name__} holds a DTensor parameter that fp.shard replaced (tensor-parallel "
            f"parameters become new parameters holding their local box): it would never train. Build the optimizer "
            "after fp.shard(model) from model.parameters()")
    sharded = [p for p in params if getattr(p, "_fp_handle", None) is not None]
    if not sharded:
        return
    _check_tensor_parallel(optimizer, sharded)
    _check_offload(optimizer, sharded)
    if owner_step.applies(type(optimizer)):      # its state lives whole on the rank that steps each parameter
        _checked_optimizers.add(optimizer)
        _owner_optimizers.add(optimizer)
        owner_step.before(optimizer)
        return
    for p in sharded:
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise OptimizerError(
                    f"{type(optimizer).__name__} state {key!r} has shape {tuple(value.shape)} but the sharded "
                    f"parameter is {tuple(p.shape)}: the optimizer stepped before fp.shard(). Build the optimizer "
                    "after fp.shard(model) from model.parameters(), or restore its state with fp.load_checkpoint")
    _check_per_tensor(optimizer, sharded)
    _checked_optimizers.add(optimizer)


def _check_offload(optimizer, sharded: list) -> None:
    """cpu_offload parameters: remember their copiers (waited on before each step) and give torch's Adam/AdamW/SGD
    their fused CPU kernel when the user chose no implementation (else one warning naming the fix)."""
    copiers = {id(c): c for c in (getattr(p._fp_handle, "offload", None) for p in sharded) if c is not None}
    if not copiers:
        return
    _offloaded[optimizer] = list(copiers.values())
    for c in copiers.values():
        c.before_host_update()
    fast_host_step(optimizer, [p for p in sharded if getattr(p._fp_handle, "offload", None) is not None])


def _after_step(optimizer, args, kwargs) -> None:
    if optimizer in _owner_optimizers:
        owner_step.after(optimizer)


def _check_per_tensor(optimizer, sharded: list) -> None:
    """A Muon by name (not torch's: that one runs the owner step) is exact on matrices no rank splits (whole
    on one rank, empty elsewhere); any other per-tensor optimizer not marked with register_per_tensor (LAMB,
    LBFGS, Shampoo...: their steps may couple parameters or communicate) needs every tensor whole everywhere."""
    cls = type(optimizer)
    if getattr(cls, "_fp_sharding_aware", False):
        return
    if cls.__name__ not in PER_TENSOR:
        return
    if cls.__name__ == "Muon":
        split = [param_info(p) for p in sharded if param_info(p).split]
        if split:
            raise OptimizerError(
                f"{cls.__module__}.Muon on a sharded model: {split[0].fqn!r} (shape {tuple(split[0].shape)}) is cut "
                f"between ranks ({len(split)} such matrices), and Newton–Schulz on a rank's rows is not Muon on the "
                "matrix. Use fp.optim.Muon (torch.optim.Muon's arguments and defaults): it is bit-identical to "
                "torch.optim.Muon on the full tensors (torch.optim.Muon itself also runs exactly, at 3x the bytes)")
        return
    pieces = [param_info(p) for p in sharded if p._fp_handle.mesh.shard_size > 1]
    if pieces:
        raise OptimizerError(
            f"{cls.__name__} is a per-tensor optimizer (whole-tensor statistics) but {pieces[0].fqn!r} is sharded "
            f"into pieces ({len(pieces)} such parameters): it would train differently from unsharded training. Use "
            "fp.optim.Muon for the 2-D hidden matrices and an elementwise optimizer (AdamW, Adam, SGD, Lion) for the "
            "rest, give this optimizer only parameters of no_shard units, or, if its step updates each parameter "
            "from that parameter alone without collectives, mark the class with fp.optim.register_per_tensor "
            "(it then runs exactly, on full tensors)")


def _check_tensor_parallel(optimizer, sharded: list) -> None:
    """A per-tensor optimizer (owner step, by name, fp.optim.Muon too) would see a TP box, not the tensor."""
    cls = type(optimizer)
    if not (owner_step.applies(cls) or cls.__name__ in PER_TENSOR):
        return
    boxes = [p for p in sharded if tp_spec(p) is not None and tp_spec(p).sharded]
    experts = [p for p in sharded if ep_spec(p) is not None]
    if experts and not boxes:
        raise OptimizerError(
            f"{cls.__name__} is a per-tensor optimizer but {param_info(experts[0]).fqn!r} holds only this rank's "
            f"experts under expert_parallel ({len(experts)} such parameters): its whole-tensor statistics would be "
            "per EP rank. Use an elementwise optimizer (AdamW, Adam, SGD, Lion) for the experts, or drop "
            "expert_parallel")
    if boxes:
        raise OptimizerError(
            f"{cls.__name__} is a per-tensor optimizer but {param_info(boxes[0]).fqn!r} is split by tensor "
            f"parallelism ({len(boxes)} such parameters): its whole-tensor statistics would be per-box. Use an "
            "elementwise optimizer (AdamW, Adam, SGD, Lion) for tensor-parallel parameters, or give this optimizer "
            "only parameters that are Replicate() on the TP mesh or plain")
