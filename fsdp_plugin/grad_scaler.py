"""`GradScaler`: torch's loss scaler, with the inf/NaN check agreed across ranks.

Each rank only sees its shard of every gradient, so an overflow may be visible on one rank alone;
without agreement that rank would skip the step while the others apply it and the replicas diverge.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._comm import collectives as comm


class GradScaler(torch.amp.GradScaler):
    """Drop-in for ``torch.amp.GradScaler`` on sharded models (same arguments and methods).

    ``group``: process group whose ranks must agree (default: the whole world).
    """

    def __init__(self, device: str = "cpu", *args, group=None, **kwargs):
        super().__init__(device, *args, **kwargs)
        self._group = group

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if dist.is_initialized() and dist.get_world_size(self._group) > 1:
            for found in per_device.values():
                comm.all_reduce(found, self._group, op=dist.ReduceOp.MAX, kind="control")
        return per_device
