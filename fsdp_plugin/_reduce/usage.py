"""Unused parameters with PyTorch's semantics: which slots got a gradient, agreed across ranks.

A flat buffer is reduced whole, so a parameter no rank used in a step would get a zero gradient and the
optimizer would still move it (momentum, Adam moments, weight decay). Single-process PyTorch and DDP leave
its ``.grad`` None (or unchanged when accumulating). Each handle records, per slot, whether autograd ran the
backward of that slot's view on this rank (``SlotUsage``); after a reducing backward every rank all-reduces
one small uint8 mask for the whole model (one control message per step, ``kind="control"``; issued before the
last gradient reduction is waited for, so the two overlap), then:

* a slot used on some ranks keeps the reduced average (unused ranks added zeros: DDP's rule);
* a slot used on no rank gets ``p.grad = None`` back if it had no gradient before this backward (its reduced
  value is exactly zero, so an accumulated gradient is left as it was);
* a handle whose gradients were accumulated under ``no_sync`` on some rank but that got no gradient in the
  reducing backward on any rank is reduced now, by every rank in unit order (zeros where nothing is pending),
  so the accumulation window is never carried silently into the next step.

Why a message every step: no rank can know locally that the others used every parameter, and carrying the
bits inside the gradient reduction would need each unit's gradient copied into a larger buffer (a full extra
pass over all gradients) to give every chunk room for them; one message of (slots + units) bytes is cheaper.

Contract (as for every collective here): a handle receives a gradient on all ranks or on none in a given
backward; parameters inside it may be used on some ranks only.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .._comm import collectives as comm, ledger
from .._groups.mesh import control_group


class SlotUsage:
    """Which slots of one handle received a gradient, locally: in the current backward (``now``) and
    in no_sync backwards whose gradients are not reduced yet (``window``)."""

    def __init__(self, n: int):
        self.now = bytearray(n)
        self.window = bytearray(n)
        self.had_grad: list[bool] = [True] * n
        self.reduced: Optional[bytes] = None   # local usage sent with this backward's reduction

    def close_backward(self, reducing: bool) -> None:
        """Fold this backward's marks into the window; a reducing backward hands the window over."""
        merged = bytes(a | b for a, b in zip(self.now, self.window))
        self.now = bytearray(len(self.now))
        if reducing:
            self.reduced, self.window = merged, bytearray(len(merged))
        else:
            self.window = bytearray(merged)


def _local_mask(h) -> bytes:
    """[used per slot..., late]: late = gradients pending from no_sync and no reduction this backward."""
    if h.usage.reduced is not None:
        return h.usage.reduced + b"\x00"
    late = h.unsharded_grad_accum is not None or any(h.usage.window)
    return bytes(h.usage.window) + (b"\x01" if late else b"\x00")


class UsageAgreement:
    """One reducing backward's mask all-reduce: ``start`` it before waiting for the last gradient reduction
    (the masks are known once every post-accumulate hook ran), ``finish`` it after every reduction finished."""

    def __init__(self, root):
        self.root = root
        self.handles = [h for u in root.units for h in u.handles if h.requires_grad]
        self.masks = [_local_mask(h) for h in self.handles]
        self.work = self.flat = None
        # the ledger hash of the pairing check rides along (``_comm/ledger.py``), on the gloo control group
        self.hashed = root.pairing == "hash"
        if self.handles and root.mesh.world_size > 1:
            data = b"".join(self.masks) + (ledger.token() if self.hashed else b"")
            # on a device the masks would make a host->device->host round trip (a host sync at every backward's
            # end, issue 48): they go on the gloo control group with CPU tensors, as the hash does
            on_control = self.hashed or root.device.type != "cpu"
            group, dev = (control_group(), torch.device("cpu")) if on_control else (None, root.device)
            self.flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            self.work = comm.all_reduce(self.flat, group, op=dist.ReduceOp.MAX, async_op=True, kind="control")

    def drain(self) -> None:
        """Wait for the all-reduce without using its result (fp.reset of a backward that raised)."""
        work, self.work, self.flat = self.work, None, None
        if work is not None:
            comm.wait(work, "unused-parameter mask all-reduce", self.handles[0].timeout_s)

    def _wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            comm.wait(work, "unused-parameter mask all-reduce", self.handles[0].timeout_s)

    def verify(self) -> None:
        """Wait for the all-reduce and check the ledger hash it carries (a no-op without one)."""
        if self.flat is None or not self.hashed:
            return
        self._wait()
        merged = bytes(self.flat[-ledger.TOKEN_BYTES:].tolist())
        ledger.verify(merged, control_group(), self.handles[0].timeout_s, self.root.divergence_hint())

    def finish(self) -> None:
        if self.flat is not None:
            self._wait()
            merged, self.masks, at = bytes(self.flat.cpu().tolist()), [], 0
            for h in self.handles:
                self.masks.append(merged[at:at + len(h.slots) + 1])
                at += len(h.slots) + 1
        for h, mask in zip(self.handles, self.masks):
            reduced_here = h.usage.reduced is not None
            h.usage.reduced = None
            if not reduced_here and mask[-1]:
                h.usage.close_backward(reducing=True)
                h.usage.reduced = None
                h.reduce_now()
            elif not reduced_here:
                continue
            h.restore_none([bool(b) for b in mask[:-1]])
