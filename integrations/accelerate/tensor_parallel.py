"""``ParallelismConfig(dp_shard_size=..., tp_size=...)`` on fsdp_plugin's engine (issue 31).

Stock accelerate keeps the ``ParallelismConfig``: it parses it (sizes, its env variables), builds and validates
its device mesh (``dp_replicate, dp_shard, tp`` plus the flattened ``dp``...) and splits the data by dp rank (the
TP ranks of one dp rank get the same batches). Here, at ``prepare``: a model without DTensor parameters gets its
transformers ``tp_plan`` on ``mesh["tp"]`` (``integrations/hf_tensor_parallel``), then ``fp.shard`` runs over the
dp dims (``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` = hybrid), and optimizers built before
``prepare`` are pointed at the new parameters (TP parameters are new ``nn.Parameter`` objects after fp.shard).
With ``cp_size > 1`` too, fp.shard runs over ``(dp_shard, cp)`` (``cp_meshes``) with ``context_parallel=cp_size``:
the engine splits each sequence over cp and TP's collectives stay on "tp"; stock accelerate's own CP hooks
(``_prepare_cp``) are skipped (``accelerator.py``).
"""
from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from fsdp_plugin.errors import OptimizerError, TensorParallelError

from .config.settings import config_error


def has_dtensors(model: nn.Module) -> bool:
    """Whether some parameter of ``model`` is a DTensor (the model is already tensor-parallel)."""
    return any(any(c.__name__ == "DTensor" for c in type(p).__mro__) for p in model.parameters())


def dp_mesh(pc: Any, mesh: Any) -> Any:
    """The data-parallel dims of accelerate's device ``mesh``: what fp.shard shards over. Raises when the
    config leaves no dp_shard dimension (tp_size alone: nothing to shard; accelerate refuses dp_replicate
    without dp_shard under TP itself)."""
    dims = tuple(pc.dp_dim_names)
    if "dp_shard" not in dims:
        raise config_error("ParallelismConfig.dp_shard_size", pc.dp_shard_size,
                           f"with tp_size={pc.tp_size} fsdp_plugin shards over the dp_shard dimension, and a size of 1 "
                           "leaves nothing to shard: set dp_shard_size >= 2 (dp_replicate_size x dp_shard_size x "
                           "tp_size = the process count), or train without FSDP for tensor parallelism alone")
    return mesh[dims[0]] if len(dims) == 1 else mesh[dims]


CP_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def cp_meshes(pc: Any, device_type: str) -> tuple[Any, Any]:
    """cp x tp: (the (dp.., cp) mesh fp.shard takes, the tp mesh) on a root mesh of accelerate's layout
    (dp_replicate, dp_shard, cp, tp; tp innermost, cp next), with the size-1 dims accelerate leaves out: the engine
    reads a (dp_shard, cp) mesh, or (dp_replicate, dp_shard, cp) for hybrid (``_groups/cp_mesh.py``), and
    accelerate's own mesh has no dp_shard dim at dp_shard_size 1."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (pc.dp_replicate_size or 1, pc.dp_shard_size or 1, pc.cp_size, pc.tp_size)
    root = init_device_mesh(device_type, sizes, mesh_dim_names=CP_DIMS)
    return root[CP_DIMS[:3] if sizes[0] > 1 else CP_DIMS[1:3]], root["tp"]


def parallelize(model: nn.Module, tp_mesh: Any) -> None:
    """Apply the model's transformers ``tp_plan`` on ``tp_mesh`` unless the model is tensor-parallel already."""
    if has_dtensors(model):
        return
    if not (getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)):
        raise TensorParallelError(
            f"ParallelismConfig(tp_size > 1) but {type(model).__name__} has no DTensor parameter and no tp_plan: "
            "parallelize it before prepare with torch's parallelize_module(model, accelerator.torch_device_mesh['tp'], "
            "plan) (or fsdp_plugin.integrations.hf_tensor_parallel.parallelize_hf with a plan of your own)")
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf

    parallelize_hf(model, tp_mesh)


def remap_optimizers(optimizers: Iterable[Any], before: dict[str, nn.Parameter], model: nn.Module) -> None:
    """Point optimizers that hold ``before``'s parameters (name -> parameter, taken before TP and fp.shard) at
    the model's parameters of the same names now; an optimizer that already has state for them is refused."""
    after = dict(model.named_parameters(remove_duplicate=False))
    new = {id(p): after[n] for n, p in before.items() if n in after and after[n] is not p}
    if not new:
        return
    for opt in optimizers:
        inner = getattr(opt, "optimizer", opt)          # accelerate's AcceleratedOptimizer wraps the user's
        if any(id(p) in new for p in inner.state):
            raise OptimizerError(
                f"{type(inner).__name__} already stepped on the model's parameters before prepare: tensor "
                "parallelism replaces them, so its state would be lost; prepare the model and the optimizer "
                "before the first step")
        for group in inner.param_groups:
            group["params"] = [new.get(id(p), p) for p in group["params"]]
