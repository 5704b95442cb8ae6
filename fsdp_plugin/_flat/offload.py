"""CPU offload's host side (issue 49): pinned master shards and gradient buffers, copies on side streams, one
host wait per backward, and the counters that prove it.

One :class:`HostCopier` per sharded model (``RootState.offload``; each offloaded handle's ``offload``) when
``cpu_offload=True`` on a CUDA device. What it does, and why (research/cpu-offload.md, suspects S1-S6):

* **Pinned, exact size.** Every host buffer (a handle's fp32 master shard, its gradient buffer, its accumulation
  staging buffer) is an anonymous ``mmap`` registered with ``cudaHostRegister``. Not torch's pinned caching host
  allocator: it rounds every block up to a power of two (a 1.05 GB embedding shard would take 2 GiB, 4.94 GB of
  masters ~6 GiB pinned), and keeps freed blocks pinned for the process's lifetime. Registration pins exactly the
  bytes asked for, once, and the block is unregistered before it is unmapped (``_PinnedBlock.__del__``).
* **Host-to-device** (``to_device``): the copy of the master runs on its own stream (``h2d``), the current stream
  waits for it on the GPU (an event; the host does not wait), and the cast to the compute dtype runs on the current
  stream, as FSDP2 does (fp32 crosses PCIe; the cast is a GPU kernel). The copy's destination is allocated on the
  stream that uses it (the current one), and ``h2d`` waits for that stream before writing it: the block belongs to
  its user's pool, which reuses it only after its own wait for the copy, so no ``record_stream`` is needed
  (``streams.py`` (b) covers the side streams: a gather stream's next op waits for compute first). At world 1 the current stream waits only at
  the handle's ``wait_unshard`` (``fill``): a prefetched unit's copy runs beside the compute of the unit that
  prefetched it (backward prefetch by default; ``forward_prefetch=True`` does the same for forward).
* **Device-to-host** (``accumulate_grad``): the reduced gradient chunk is copied ``non_blocking`` on a second
  stream (``d2h``) after an event from the current stream, into the handle's persistent pinned gradient buffer; the
  slots' ``p.grad`` views are bound into it at once. The host waits ONCE, at the end of backward
  (``finish_backward``: the last copy's event; copies on one stream finish in order), never per unit. The chunk
  the copy reads is held by the copier (``_reading``, with the copy's event) until the current stream has waited for
  that event on the GPU (at the next gradient copy) or the host has (at the end of backward): only then does it go
  back to the allocator, whose pool's stream is thereby ordered after the read (FSDP2's ``ReduceScatterState``).
* **Gradient buffer reuse.** The engine's rule without offload: ``p.grad`` are views of one flat buffer that the
  handle does not keep, so ``zero_grad(set_to_none=True)`` frees it. Under offload the pinned buffer is kept and
  reused at the next backward *only if nothing outside holds it* (storage use count): a gradient the user kept a
  reference to keeps its values, and a fresh pinned buffer is made (counted in ``stats.host_allocs``). Gradients
  still bound (``set_to_none=False``, accumulation over micro-batches) are added to: the copy lands in a
  persistent pinned staging buffer and is added after the end-of-backward wait.

Streams and events exist only on CUDA (``_CudaBackend``). Tests drive the same code on CPU through a backend whose
streams and events are recorders (``tests/test_offload.py``): every copy, wait and allocation goes through the
backend, and :class:`OffloadStats` counts them; ``tests/test_offload_streams.py`` runs a short training's copies
under the caching allocator's pool model (``tests/_pools.py``), which fails with any one of the waits above removed.
"""
from __future__ import annotations

import mmap
import os
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .. import _compat


@dataclass
class OffloadStats:
    """Counts since the copier was made (``reset`` zeroes them): host waits (``syncs``), host buffers created
    (``host_allocs``, ``host_alloc_bytes``), copies and their bytes each way."""

    syncs: int = 0
    host_allocs: int = 0
    host_alloc_bytes: int = 0
    h2d_copies: int = 0
    h2d_bytes: int = 0
    d2h_copies: int = 0
    d2h_bytes: int = 0
    sync_sites: dict = field(default_factory=dict)   # why the host waited -> count

    def reset(self) -> None:
        self.__init__()

    def snapshot(self) -> dict:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


# ------------------------------------------------------------------ pinned memory, exact size
class _PinnedBlock(mmap.mmap):
    """Anonymous memory that ``unregister`` un-pins before it is unmapped (``__del__`` runs before mmap's own
    deallocation). Tensors made with ``torch.frombuffer`` keep it alive."""

    unregister: Optional[Callable] = None
    ptr: int = 0

    def __del__(self):
        if self.unregister is not None:
            try:
                self.unregister(self.ptr)
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
                pass


def host_block(numel: int, dtype: torch.dtype, register: Optional[Callable] = None,
               unregister: Optional[Callable] = None) -> torch.Tensor:
    """A zero-filled host tensor of exactly ``numel`` elements on its own pages, ``register(ptr, nbytes)``'d
    (pinned) when given; ``unregister(ptr)`` runs when the last tensor using it is gone."""
    nbytes = numel * dtype.itemsize
    block = _PinnedBlock(-1, max(nbytes, 1))
    out = torch.frombuffer(block, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)
    if register is not None and nbytes:
        register(out.data_ptr(), nbytes)
        block.ptr, block.unregister = out.data_ptr(), unregister
    return out


def _cuda_register(ptr: int, nbytes: int) -> None:
    err = _compat.cuda_host_register(ptr, nbytes)
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed ({err}): pinned host memory is limited by "
                           "`ulimit -l` and the machine's RAM; cpu_offload needs the master shards, gradients and "
                           "optimizer state in host memory")


def _cuda_unregister(ptr: int) -> None:
    _compat.cuda_host_unregister(ptr)


# ------------------------------------------------------------------ backends
class _CudaBackend:
    """Real streams and events on one CUDA device; pinned host blocks by cudaHostRegister."""

    non_blocking = True

    def __init__(self, device: torch.device):
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)

    def current(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

    def event(self, stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return host_block(numel, dtype, _cuda_register, _cuda_unregister)


def for_config(cpu_offload: bool, device: torch.device) -> Optional["HostCopier"]:
    """The model's copier: ``cpu_offload`` on CUDA; None otherwise (``fsdp_plugin.testing.fake``: on CPU too). On a CPU device
    ``cpu_offload`` does nothing (the shards already live in host memory): one warning says so."""
    if not cpu_offload:
        return None
    if device.type == "cuda":
        return HostCopier(device, _CudaBackend(device))
    warnings.warn(f"cpu_offload=True does nothing on a {device.type} device: the shards, gradients and optimizer "
                  "state are in host memory already; drop cpu_offload (or train on a CUDA device to offload)",
                  UserWarning, stacklevel=3)
    return None


def _use_count(t: torch.Tensor) -> int:
    n = _compat.storage_use_count(t.untyped_storage())
    return n if n is not None else 1 << 30     # unknown: referenced (a fresh buffer, never a reused one)


# ------------------------------------------------------------------ the copier
_LIVE: "weakref.WeakSet" = weakref.WeakSet()     # every copier alive (a checkpoint load writes masters of any)


def before_any_host_write() -> None:
    """Before a write to master shards that does not know their handles (a checkpoint load's copies): every live
    copier's reading copies are done (``HostCopier.before_host_write``; nothing to wait for is free)."""
    for copier in list(_LIVE):
        copier.before_host_write()


class HostCopier:
    """Host buffers and the copies between them and the device for every offloaded handle of one model."""

    def __init__(self, device: torch.device, backend):
        self.device, self.backend = torch.device(device), backend
        _LIVE.add(self)
        self.stats = OffloadStats()
        self._grad_bufs: dict = {}      # id(handle) -> its persistent pinned gradient buffer (reused when free)
        self._staging: dict = {}        # id(handle) -> pinned staging buffer for accumulating backwards
        self._adds: list = []           # (destination, source) additions waiting for the end-of-backward wait
        self._last_d2h = None           # the newest device-to-host copy's event (one stream: they finish in order)
        self._reading: list = []        # (device chunk, its copy's event): read by d2h, not yet released
        # host-to-device copies (all on the h2d stream, in order) issued, and how many of them the host has seen
        # finish by synchronizing an h2d event recorded after them: the only fact a host write to the masters
        # may rely on (no reasoning through other streams' waits; issue 53, finding 10)
        self._h2d_issued = 0
        self._h2d_synced = 0
        self._lone = _use_count(torch.empty(1))   # a tensor's storage use count when nothing else holds it

    # ---------------------------------------------------------------- host memory
    def host_tensor(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new pinned (registered) zero-filled host buffer; counted."""
        self.stats.host_allocs += 1
        self.stats.host_alloc_bytes += numel * dtype.itemsize
        return self.backend.pinned(numel, dtype)

    # ---------------------------------------------------------------- host -> device
    def to_device(self, shard: torch.Tensor, handle=None):
        """A device copy of ``shard`` (its dtype) made on the h2d stream; the host does not wait. Without
        ``handle``: ready on the current stream (it waits for the copy on the GPU now: an all-gather's source).
        With ``handle`` (world 1): ``(event, copy)`` for ``fill`` at the handle's ``wait_unshard``, so the compute
        queued before then (the unit that prefetched it) runs beside the copy."""
        b = self.backend
        current = b.current()
        out = torch.empty(shard.shape, dtype=shard.dtype, device=self.device)   # in the pool of its user
        b.h2d.wait_event(b.event(current))        # the block's earlier users on that stream are done with it
        with b.use(b.h2d):
            out.copy_(shard, non_blocking=b.non_blocking)
            done = b.event(b.h2d)
        self.stats.h2d_copies += 1
        self.stats.h2d_bytes += shard.numel() * shard.element_size()
        self._h2d_issued += 1
        if handle is not None:
            return done, out        # ``fill`` runs on the stream current now (the handle's compute stream)
        current.wait_event(done)
        return out

    def fill(self, copy, full: torch.Tensor) -> None:
        """The current stream waits (on the GPU) for a ``to_device(..., handle)`` copy and casts it into ``full``."""
        done, out = copy
        self.backend.current().wait_event(done)
        full.copy_(out)

    # ---------------------------------------------------------------- device -> host
    def accumulate_grad(self, handle, reduced: torch.Tensor) -> None:
        """``FlatParamHandle._accumulate_shard_grad`` under offload: the reduced chunk (device) goes to the handle's
        pinned gradient buffer without the host waiting; ``p.grad`` views are bound at once and hold the values
        after ``finish_backward``."""
        self._release_reading()
        if reduced.dtype != handle.dtype:
            reduced = reduced.to(handle.dtype)          # on the GPU (FSDP2 and DeepSpeed send fp32 too)
        base = handle._grad_base()
        handle.usage.had_grad = [s.param.grad is not None for s in handle.slots]
        if base is not None:              # accumulating: land in staging, add after the wait
            staging = self._staging.get(id(handle))
            if staging is None or staging.numel() != reduced.numel():
                staging = self._staging[id(handle)] = self.host_tensor(reduced.numel(), handle.dtype)
            self._copy_to_host(staging, reduced)
            self._adds.append((base, staging))
        else:
            base = self._grad_buffer(handle, reduced.numel())
            self._copy_to_host(base, reduced)
            for s, had in zip(handle.slots, handle.usage.had_grad):
                if had:      # some slots kept an older gradient (unused, or the user set others to None)
                    self._adds.append((base[handle.local_slice(s)], s.param.grad.reshape(-1)))
        for s in handle.slots:
            s.param.grad = base[handle.local_slice(s)].view(s.param.shape)

    def _grad_buffer(self, handle, numel: int) -> torch.Tensor:
        """The handle's persistent pinned gradient buffer if nothing outside holds it, else a new one."""
        buf = self._grad_bufs.get(id(handle))
        if buf is None or buf.numel() != numel or _use_count(buf) > self._lone:
            buf = self._grad_bufs[id(handle)] = self.host_tensor(numel, handle.dtype)
        return buf

    def _copy_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        b = self.backend
        ready = b.event(b.current())       # the gradient is produced on the current stream
        b.d2h.wait_event(ready)
        with b.use(b.d2h):
            dst.copy_(src, non_blocking=b.non_blocking)
            self._last_d2h = b.event(b.d2h)
        self._reading.append((src, self._last_d2h))     # released by ``_release_reading`` or ``finish_backward``
        self.stats.d2h_copies += 1
        self.stats.d2h_bytes += src.numel() * src.element_size()

    def _release_reading(self) -> None:
        """The current stream waits (on the GPU) for the copies still reading device chunks, then the chunks go.
        A chunk's pool is the current stream's or the reduce stream's, which waits for the current stream before
        its next op (``streams.py`` (b)): either way its reuse is ordered after the copy."""
        if not self._reading:
            return
        current = self.backend.current()
        current.wait_event(self._reading[-1][1])      # one stream: the newest copy's event covers the others
        self._reading.clear()

    # ---------------------------------------------------------------- host waits
    def _sync(self, event, site: str) -> None:
        event.synchronize()
        self.stats.syncs += 1
        self.stats.sync_sites[site] = self.stats.sync_sites.get(site, 0) + 1

    def finish_backward(self) -> None:
        """End of backward (and fp.reset: the copies already issued land before anything is freed): the one host
        wait for the gradients (the newest gradient copy; all earlier ones are done then) and for the host-to-device
        copies issued before them, then the deferred accumulations."""
        last, self._last_d2h = self._last_d2h, None
        if last is not None:
            # the same host wait also covers every host-to-device copy issued so far (they read the masters the
            # optimizer step writes next): the d2h stream waits on the GPU for an h2d event, so an event recorded
            # after that wait finishes after both streams' work (tests/test_offload.py's vector-clock backend)
            b, issued = self.backend, self._h2d_issued
            if self._h2d_synced != issued:
                b.d2h.wait_event(b.event(b.h2d))
                last = b.event(b.d2h)
            self._sync(last, "end_of_backward")
            self._h2d_synced = issued
        self._reading.clear()         # the host saw every copy finish (or none was issued)
        adds, self._adds = self._adds, []
        for dst, src in adds:
            dst.add_(src.reshape(dst.shape))

    def before_host_update(self) -> None:
        """Before the host writes master shards (an optimizer step): the gradients landed, and no copy reading
        the masters is still running (`before_host_write`)."""
        self.finish_backward()
        self.before_host_write("before_optimizer_step")

    def before_host_write(self, site: str = "before_host_write") -> None:
        """Before the host writes master shards (an optimizer step, a state-dict load): every host-to-device copy
        issued so far has finished — the host synchronizes a fresh event on the h2d stream, where every copy
        reading the masters runs, in order. Skipped only when no copy was issued since the last such wait."""
        if self._h2d_synced == self._h2d_issued:
            return
        b, issued = self.backend, self._h2d_issued
        self._sync(b.event(b.h2d), site)
        self._h2d_synced = issued


# ------------------------------------------------------------------ the optimizer step on the host
# torch's Adam/AdamW/SGD run their one-tensor-at-a-time loop on CPU tensors unless ``fused=True`` (CPU is not a
# foreach device). Their fused CPU kernels: SGD bit-identical to the loop; Adam/AdamW within one float32 ulp of it
# (1.2e-7 on values ~1 after 10 steps, tests/test_offload.py). Switched on for offloaded parameters when the user
# set neither ``fused`` nor ``foreach``; ``FSDP_PLUGIN_OFFLOAD_FUSED=0`` keeps torch's loop.
_FUSABLE = ("Adam", "AdamW", "SGD")
_advised: "weakref.WeakSet" = weakref.WeakSet()     # optimizers already told about their slow host loop


def fast_host_step(optimizer, params: list) -> Optional[str]:
    """At an optimizer's first step over offloaded ``params``: switch torch's Adam/AdamW/SGD to their fused CPU
    kernel when the user chose no implementation and every parameter of every group can take it (one warning
    says so and names the opt-outs); otherwise warn once when its CPU path is the slow loop. ``defaults`` are
    left alone: groups added later are the user's choice. Returns what was done ("fused", "warned") or None."""
    cls = type(optimizer)
    groups = optimizer.param_groups
    if not all(p.device.type == "cpu" for p in params) or "fused" not in optimizer.defaults \
            or all(g.get("fused") for g in groups):
        return None       # not on the host, not torch's kind (DeepSpeedCPUAdam is fast already), or fused already
    if cls.__module__.startswith("torch.optim") and cls.__name__ in _FUSABLE:
        if os.environ.get("FSDP_PLUGIN_OFFLOAD_FUSED", "1") == "0":
            return None   # the user keeps torch's loop on purpose
        chosen = any(g.get("foreach") is not None or g.get("fused") is not None or g.get("differentiable")
                     for g in groups)
        # what the constructor's fused=True would check, for every parameter (offloaded or not): host, float
        fusable = all(p.device.type == "cpu" and p.dtype in (torch.float32, torch.float64)
                      for g in groups for p in g["params"])
        if not chosen and fusable:
            for g in groups:
                g["fused"], g["foreach"] = True, False
            warnings.warn(f"cpu_offload: {cls.__name__} now steps with its fused CPU kernel (fused=True in every "
                          "param group; about 3-5x faster than torch's one-tensor-at-a-time loop, within an ulp or "
                          f"two of it). Construct it with fused=True (torch.optim.{cls.__name__}(..., fused=True)) "
                          "to choose it yourself, or set FSDP_PLUGIN_OFFLOAD_FUSED=0 to keep the loop.",
                          UserWarning, stacklevel=4)
            return "fused"
    if optimizer not in _advised:
        _advised.add(optimizer)
        warnings.warn(f"cpu_offload: {cls.__name__} steps the offloaded parameters on the CPU with torch's "
                      "one-tensor-at-a-time loop (about 3-5x slower than its fused CPU kernel): construct it with "
                      f"fused=True (torch.optim.{cls.__name__}(..., fused=True))", UserWarning, stacklevel=4)
        return "warned"
    return None
