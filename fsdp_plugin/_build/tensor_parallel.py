"""fp.shard on a tensor-parallel model: DTensor parameters on one TP mesh dimension become plain parameters
holding their local TP tensor, with the spec kept on ``p._fp_tp`` (see ``_flat/dtensor.py``).

Supported: parameters that are DTensors on a 1-D TP mesh, placements ``Shard(d)`` or ``Replicate()``, the TP
mesh and ``device_mesh`` (the data-parallel mesh given to fp.shard) slices of one root mesh, disjoint, and
together covering the world. Everything else raises `TensorParallelError` naming what to do. A DTensor
parameter cannot change its Python type in place (``swap_tensors`` refuses different slots), so each one is
replaced by a new ``nn.Parameter`` at every site that registers it; the old one is marked ``_fp_replaced`` so an
optimizer built on it before fp.shard is refused at its first step.
"""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from .. import _compat
from .._flat.dtensor import TPSpec
from ..errors import TensorParallelError

_FIX_ORDER = ("parallelize the model with torch's parallelize_module on mesh['tp'] first, then call "
              "fp.shard(model, device_mesh=mesh['dp']) (a 2-D mesh['dp_replicate', 'dp_shard'] with "
              "sharding_strategy='hybrid_shard')")


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" or any(c.__name__ == "DTensor" for c in type(t).__mro__)


def refuse_fsdp2(model: nn.Module) -> None:
    """A module torch's fully_shard already wrapped holds dp-sharded DTensors: sharding it twice is wrong."""
    for name, m in model.named_modules():
        if any(c.__name__ == "FSDPModule" for c in type(m).__mro__):
            raise TensorParallelError(
                f"module {name or '<root>'!r} ({type(m).__name__}) is already wrapped by torch's fully_shard (FSDP2): "
                f"build the model without fully_shard; {_FIX_ORDER}")


def strip_dtensors(model: nn.Module, dp_mesh, param_init_fn) -> Optional[object]:
    """Replace every DTensor parameter by a plain one holding its local tensor; return the TP mesh (None: the
    model has no DTensor parameter). Validates placements and meshes first, on every rank alike."""
    refuse_fsdp2(model)
    _refuse_dtensor_buffers(model)
    found = [(n, p) for n, p in model.named_parameters() if _is_dtensor(p)]
    grad_sum = _grad_allreduce_modules(model)
    if not found:
        if grad_sum:
            raise TensorParallelError(f"module {grad_sum[0][0]!r} is parallelized with transformers' "
                                      "replicated_with_grad_allreduce but no parameter is a DTensor: parallelize "
                                      "the model with its whole tp_plan, or drop that entry")
        return None
    tp_mesh = _check_meshes(found, dp_mesh)
    _mark_grad_sum(grad_sum, tp_mesh)
    new: dict[int, nn.Parameter] = {}
    for name, p in found:
        spec = _spec_of(name, p, tp_mesh)
        local = p._local_tensor
        if local.is_meta and param_init_fn != "skip":
            raise TensorParallelError(
                f"parameter {name!r} is a DTensor on the meta device: fp.shard cannot initialize a tensor-parallel "
                "box of a meta tensor yet. Build the model on a real device before parallelize_module, or pass "
                "param_init_fn='skip' and fill it right after fp.shard with fp.load_checkpoint / fp.load_pretrained")
        q = nn.Parameter(local.detach(), requires_grad=p.requires_grad)
        q.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_is_param"})
        q._fp_tp = spec
        p._fp_replaced = True
        new[id(p)] = q
    for m in model.modules():
        for attr, p in list(m._parameters.items()):
            if p is not None and id(p) in new:
                m._parameters[attr] = new[id(p)]
    return tp_mesh


_GRAD_ALLREDUCE = "ReplicatedWithGradAllReduce.install_forward."


def _grad_allreduce_modules(model: nn.Module) -> list:
    """``(name, module, mesh, original forward)`` of every module transformers' ``replicated_with_grad_allreduce``
    style wrapped (Qwen3's q_norm/k_norm: a replicated weight whose gradient covers this TP rank's heads only).
    Its wrapper registers gradient hooks on the module's parameters at each forward, which cannot work on the
    views of a flat buffer: fp.shard sums those gradients over TP itself (``TPSpec.grad_sum``)."""
    out = []
    for name, m in model.named_modules():
        fn = m.__dict__.get("forward")
        if fn is None or not getattr(fn, "__qualname__", "").startswith(_GRAD_ALLREDUCE) or not fn.__closure__:
            continue
        cells = _cells(fn)
        mesh = cells.get("mesh") or _cells(cells.get("_all_reduce_grad")).get("mesh")   # the grad hook holds it
        out.append((name, m, mesh, cells.get("original_forward")))
    return out


def _cells(fn) -> dict:
    if not callable(fn) or not getattr(fn, "__closure__", None):
        return {}
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))


def _mark_grad_sum(found: list, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate
    for name, m, mesh, original in found:
        if mesh is None or original is None or mesh != tp_mesh:
            raise TensorParallelError(f"module {name!r}: its replicated_with_grad_allreduce wrapper is not on the "
                                      f"model's TP mesh {tp_mesh.mesh_dim_names}; parallelize every module on the "
                                      "same mesh['tp']")
        if getattr(original, "__func__", None) is type(m).forward and getattr(original, "__self__", None) is m:
            del m.__dict__["forward"]
        else:
            m.forward = original
        for p in m.parameters(recurse=False):
            p._fp_tp = TPSpec(tp_mesh, (Replicate(),), p.shape, tuple(p.stride()), (0,) * p.dim(), grad_sum=True)


def _check_meshes(found, dp_mesh):
    # by equality, not identity: DTensor's sharding-propagation cache hands out an equal mesh of an earlier root
    # (a second init_device_mesh of the same layout in one process: a second Accelerator, Trainer after a loop)
    meshes = {p.device_mesh: (n, p.device_mesh) for n, p in found}
    if len(meshes) > 1:
        (n0, m0), (n1, m1) = list(meshes.values())[:2]
        raise TensorParallelError(f"parameters {n0!r} and {n1!r} are DTensors on different meshes "
                                  f"({m0.mesh_dim_names} and {m1.mesh_dim_names}): parallelize every module on the "
                                  "same mesh['tp']")
    name, tp_mesh = next(iter(meshes.values()))
    if tp_mesh.ndim != 1:
        raise TensorParallelError(
            f"parameter {name!r} is a DTensor on a {tp_mesh.ndim}-D mesh {tp_mesh.mesh_dim_names}: tensor parallelism "
            "over more than one mesh dimension is not supported; parallelize on one dimension (mesh['tp']) and give "
            "fp.shard the data-parallel dimensions as device_mesh")
    if dp_mesh is None or isinstance(dp_mesh, tuple):
        raise TensorParallelError(
            f"the model is tensor-parallel (parameter {name!r} is a DTensor on {tp_mesh.mesh_dim_names}) but fp.shard "
            "got no data-parallel DeviceMesh: pass device_mesh=mesh['dp'] (the dims of the same root mesh that are "
            "not 'tp')")
    if _compat.root_mesh(tp_mesh) != _compat.root_mesh(dp_mesh):
        raise TensorParallelError(
            f"the tensor-parallel mesh of {name!r} ({tp_mesh.mesh_dim_names}) and device_mesh "
            f"({dp_mesh.mesh_dim_names}) are not slices of one root mesh: build one with init_device_mesh(device, "
            "(dp, tp), mesh_dim_names=('dp', 'tp')) and pass mesh['tp'] to parallelize_module, mesh['dp'] to fp.shard")
    overlap = set(tp_mesh.mesh_dim_names or ()) & set(dp_mesh.mesh_dim_names or ())
    world = dist.get_world_size() if dist.is_initialized() else 1
    if overlap or tp_mesh.size() * dp_mesh.size() != world:
        raise TensorParallelError(
            f"device_mesh {dp_mesh.mesh_dim_names} (size {dp_mesh.size()}) and the tensor-parallel mesh "
            f"{tp_mesh.mesh_dim_names} (size {tp_mesh.size()}) must be disjoint dimensions covering the world of "
            f"{world} ranks: pass the data-parallel dims only, e.g. device_mesh=mesh['dp']")
    return tp_mesh


def _spec_of(name: str, p, tp_mesh) -> TPSpec:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for pl in p.placements:
        kind = type(pl).__name__
        if kind == "_StridedShard":
            raise TensorParallelError(
                f"parameter {name!r} has placement {pl}: a strided shard (a packed layout such as transformers' "
                "packed_colwise/packed_rowwise for fused gate_up or MoE expert tensors, or TP inside another "
                "sharding) is not supported: leave those entries (and moe_tp_experts on their module) out of the "
                f"TP plan, so the tensors stay whole on every TP rank; {_FIX_ORDER}")
        if pl.is_partial():
            raise TensorParallelError(
                f"parameter {name!r} has placement {pl}: a Partial parameter (pending reduction) has no local value "
                "to train; redistribute it to Replicate() (or Shard(d)) before fp.shard")
        if not (pl.is_shard() or pl.is_replicate()):
            raise TensorParallelError(f"parameter {name!r} has placement {pl}: only Shard(d) and Replicate() "
                                      "tensor-parallel parameters are supported")
    local_shape, offset = compute_local_shape_and_global_offset(p.shape, tp_mesh, p.placements)
    if tuple(local_shape) != tuple(p._local_tensor.shape):
        raise TensorParallelError(f"parameter {name!r}: its local tensor {tuple(p._local_tensor.shape)} is not the "
                                  f"{tuple(local_shape)} box its placements {p.placements} give; build it with "
                                  "distribute_tensor / parallelize_module")
    return TPSpec(tp_mesh, tuple(p.placements), p.shape, tuple(p.stride()), tuple(offset))


def _refuse_dtensor_buffers(model: nn.Module) -> None:
    """Buffers as DTensors are not sharded by fp.shard and would be broadcast as plain tensors: refuse."""
    for name, b in model.named_buffers():
        if _is_dtensor(b):
            raise TensorParallelError(f"buffer {name!r} is a DTensor: fp.shard keeps buffers whole on every rank; "
                                      "register it as a plain tensor (replicated) instead")


def tp_rank_and_size(tp_mesh) -> tuple[int, int]:
    """(this rank's TP coordinate, TP size); (0, 1) without tensor parallelism."""
    if tp_mesh is None:
        return 0, 1
    return tp_mesh.get_local_rank(), tp_mesh.size()

