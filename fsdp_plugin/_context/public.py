"""The data-parallel view and the gather of split outputs (``fp.data_parallel_rank/size``, ``fp.gather_sequence``)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from ..errors import UsageError


def _mesh(model):
    root = getattr(model, "_fp_root", None) if model is not None else None
    return root.mesh if root is not None else None


def data_parallel_size(model: nn.Module = None) -> int:
    """Ranks with distinct batches: the world divided by ``context_parallel`` of the sharded ``model`` (the world,
    or 1 without a process group, when ``model`` is None or not split). Samplers split the data over these."""
    mesh = _mesh(model)
    if mesh is not None:
        return mesh.dp_size
    return dist.get_world_size() if dist.is_initialized() else 1


def data_parallel_rank(model: nn.Module = None) -> int:
    """This rank's data-parallel index (rank // context_parallel): every rank of a CP group gets the same one."""
    mesh = _mesh(model)
    if mesh is not None:
        return mesh.dp_rank
    return dist.get_rank() if dist.is_initialized() else 0


def gather_sequence(model: nn.Module, local: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The whole-sequence tensor of a context-parallel model's last forward, from this rank's ``local`` part
    (``out.logits``, hidden states: positions along ``dim``), in sequence order, padding dropped. Collective
    over the CP group; no autograd (for metrics and evaluation). A model without CP returns ``local``.
    ``model``: the module given to fp.shard (a LightningModule holding the transformers model is fine)."""
    layout = getattr(model, "_fp_cp_layout", None)
    mesh = _mesh(model)
    if mesh is None or mesh.cp_size == 1:
        return local
    if layout is None:
        raise UsageError("fp.gather_sequence: run a forward of the context-parallel model first (it gathers that "
                         "forward's outputs)")
    if local.shape[dim] != layout.q_index.numel():
        raise UsageError(f"fp.gather_sequence: dim {dim} of the tensor has {local.shape[dim]} positions, the last "
                         f"forward gave this rank {layout.q_index.numel()}: pass that forward's output")
    local = local.detach().contiguous()
    outs = [torch.empty_like(local) for _ in range(layout.cp)]
    comm.all_gather_list(outs, local, layout.group, what="fp.gather_sequence", kind="cp_gather")
    joined = torch.cat(outs, dim)
    order = torch.argsort(layout.kv_index).to(local.device)
    return joined.index_select(dim, order[:layout.seq_len])
