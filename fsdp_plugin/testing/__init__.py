"""Testing helpers users can run on their own machines (public, documented in README "Testing NCCL code on a CPU").

Importing this package registers the ``nccl_sim`` process-group backend (:mod:`.nccl_sim`): a CPU backend with
NCCL's completion semantics (asynchronous completion on a worker thread, truthful ``is_completed()``, abort,
a hang for mismatched collectives), counting every call that would block the host on NCCL::

    import fsdp_plugin.testing                      # registers "nccl_sim"
    dist.init_process_group("nccl_sim")             # under torchrun, or with store=/rank=/world_size=
    ...
    fsdp_plugin.testing.COUNTERS.host               # Counter of host-blocking calls (0 in a step: good)
"""
from .nccl_sim import BACKEND, COUNTERS, Counters, SimGroup, SimWork, register

register()

__all__ = ["BACKEND", "COUNTERS", "Counters", "SimGroup", "SimWork", "register"]
