"""``FSDPPluginStrategy(data_parallel_size=..., tensor_parallel_size=...)``: Lightning ModelParallelStrategy's 2-D
mesh and ``configure_model`` contract on fsdp_plugin's engine (issue 31).

As with ``ModelParallelStrategy``: sizes ``"auto"`` are the node count (dp) and the devices per node (tp), the mesh
is ``init_device_mesh(device, (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))``, reachable as
``self.device_mesh`` in the LightningModule, whose ``configure_model`` (required) parallelizes on
``self.device_mesh["tensor_parallel"]``. Instead of the user's ``fully_shard``, the strategy then runs
``fp.shard`` over ``device_mesh["data_parallel"]``; the distributed sampler splits the data over dp ranks only.
"""
from __future__ import annotations

from typing import Any, Literal, Union

import torch
from torch import nn

from fsdp_plugin.errors import ConfigError, TensorParallelError, UnsupportedError, UsageError

Size = Union[int, Literal["auto"], None]
DIM_NAMES = ("data_parallel", "tensor_parallel")


def requested(dp: Size, tp: Size) -> bool:
    """Whether the 2-D mode is asked for (either size given)."""
    return dp is not None or tp is not None


def refuse_context_parallel(dp: Size, tp: Size, cp: int) -> None:
    """Lightning's mesh is 2-D (data_parallel, tensor_parallel): no CP dimension to split sequences over, and its
    sampler would give the ranks of a CP group different samples. Refused when the strategy is built."""
    if requested(dp, tp) and cp > 1:
        raise UnsupportedError(
            f"FSDPPluginStrategy(context_parallel={cp}, tensor_parallel_size={tp!r}): context parallel with "
            "tensor parallel is not supported by the Lightning strategy (its mesh is ('data_parallel', "
            "'tensor_parallel'), no CP dimension). Use accelerate's ParallelismConfig(cp_size=..., tp_size=...) "
            "with fsdp_plugin's Accelerator, or the engine API: init_device_mesh(device, (dp, cp, tp), "
            "mesh_dim_names=('dp', 'cp', 'tp')), parallelize on mesh['tp'], fp.shard(model, device_mesh="
            "mesh['dp', 'cp'], context_parallel=cp) (README \"Context parallel\"); or drop one of the two")


def resolve(dp: Size, tp: Size, num_nodes: int, num_processes: int) -> tuple[int, int]:
    """ModelParallelStrategy's defaults (``"auto"`` or unset: dp = nodes, tp = devices per node), checked against
    the world (``num_nodes * num_processes``)."""
    dp = num_nodes if dp in ("auto", None) else dp
    tp = num_processes if tp in ("auto", None) else tp
    world = num_nodes * num_processes
    if not (isinstance(dp, int) and isinstance(tp, int) and dp >= 1 and tp >= 1) or dp * tp != world:
        raise ConfigError(f"FSDPPluginStrategy(data_parallel_size={dp!r}, tensor_parallel_size={tp!r}): the two "
                          f"sizes must be positive integers whose product is the world size ({world} = "
                          f"{num_nodes} node(s) x {num_processes} device(s)); 'auto' means nodes x devices per node")
    return dp, tp


def build_mesh(dp: int, tp: int, device: torch.device) -> Any:
    """The ``("data_parallel", "tensor_parallel")`` DeviceMesh ModelParallelStrategy builds."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=DIM_NAMES)


def check_configured(module: Any) -> None:
    """``configure_model`` is where the model is parallelized (ModelParallelStrategy requires it too)."""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if not is_overridden("configure_model", module):
        raise UsageError(f"FSDPPluginStrategy(tensor_parallel_size=...) needs {type(module).__name__}.configure_model(): "
                         "parallelize the model there with parallelize_module(..., self.device_mesh['tensor_parallel'], "
                         "plan) (the strategy then shards it over 'data_parallel'; do not call fully_shard)")


def check_parallelized(module: nn.Module, tp: int) -> None:
    """A 2-D run whose ``configure_model`` left no DTensor parameter would shard over half a mesh: refuse."""
    if tp > 1 and not any(any(c.__name__ == "DTensor" for c in type(p).__mro__) for p in module.parameters()):
        raise TensorParallelError(
            f"FSDPPluginStrategy(tensor_parallel_size={tp}) but {type(module).__name__}.configure_model() parallelized "
            "nothing (no DTensor parameter): call parallelize_module(self.model, self.device_mesh['tensor_parallel'], "
            "plan) there, or drop tensor_parallel_size for data parallelism alone")


def sampler_kwargs(mesh: Any) -> dict[str, int]:
    """DistributedSampler over the dp ranks: the TP ranks of one dp rank read the same samples."""
    dp = mesh["data_parallel"]
    return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}


def tp_size(strategy: Any) -> int:
    """The strategy's TP degree (1 without the 2-D mode)."""
    mesh = getattr(strategy, "_device_mesh", None)
    return mesh["tensor_parallel"].size() if mesh is not None else 1


def refuse_uneven(tp: int) -> None:
    """Uneven training batches are shadowed under torch's Join (``_uneven``), which is verified for data
    parallelism only: with TP, refuse (on every rank: the evenness test is collective) instead of guessing."""
    if tp > 1:
        raise UsageError(f"FSDPPluginStrategy(tensor_parallel_size={tp}): the data-parallel ranks have different numbers "
                         "of training batches this epoch (or an unsized loader), and shadowing a finished rank's steps "
                         "is not supported with tensor parallelism: give every dp rank the same number of batches "
                         "(use_distributed_sampler=True, drop_last=True, or limit_train_batches)")
