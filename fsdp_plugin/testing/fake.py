"""Stand-ins that let the CUDA-only parts of the engine run on a laptop (public: README "Estimate a cluster's
memory on one machine"; the test suite and benchmarks' ``--dry`` rehearsals use them too).

* `fake_world`: torch's fake process group — one CPU process plays one rank of a world of any size.
* `FakeBackend` / `offload_on_cpu`: ``cpu_offload=True`` on a CPU device takes the CUDA offload code path, its
  streams and events replaced by recorders that count what a CUDA run would do.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist

from .. import _compat
from .._flat import offload as _offload


def fake_world(world_size: int, rank: int = 0) -> None:
    """``dist.init_process_group("fake", ...)`` as rank ``rank`` of ``world_size``: collectives return at once
    and move nothing, so the real engine shards, trains, checkpoints and reports memory as that rank would."""
    dist.init_process_group("fake", store=_compat.fake_store(), rank=rank, world_size=world_size)


class FakeBackend:
    """The offload copier's backend on CPU: copies run at once; streams and events are recorders that count
    GPU-side waits (``Stream.waited``) and the events the host synchronized on (``Event.synced``); pinned
    blocks come from ``offload.host_block`` with counting register/unregister (``registered``: pinned now)."""

    non_blocking = False

    class Stream:
        def __init__(self, name: str):
            self.name, self.waited = name, 0

        def wait_event(self, event) -> None:
            self.waited += 1

    class Event:
        def __init__(self, stream):
            self.stream, self.synced = stream, 0

        def synchronize(self) -> None:
            self.synced += 1

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.h2d, self.d2h, self._current = self.Stream("h2d"), self.Stream("d2h"), self.Stream("current")
        self.registered: dict = {}

    def current(self):
        return self._current

    def use(self, stream):
        return contextlib.nullcontext()

    def event(self, stream):
        return self.Event(stream)

    def pinned(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return _offload.host_block(numel, dtype, self.registered.__setitem__, self.registered.pop)


def offloading_for_config(factory: Callable = FakeBackend) -> Callable:
    """A replacement for ``fsdp_plugin._flat.offload.for_config`` whose copiers use ``factory(device)`` as their
    backend on any device (``monkeypatch.setattr(offload, "for_config", offloading_for_config())``)."""
    def for_config(cpu_offload: bool, device: torch.device):
        return _offload.HostCopier(device, factory(device)) if cpu_offload else None
    return for_config


def offload_on_cpu(factory: Callable = FakeBackend) -> Callable:
    """Install `offloading_for_config` for this process (a forked rank, a ``--dry`` rehearsal); returns the
    function that restores the real one."""
    real = _offload.for_config
    _offload.for_config = offloading_for_config(factory)
    return lambda: setattr(_offload, "for_config", real)
