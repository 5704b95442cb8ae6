"""Named states of the engine's runtime objects (the model: torch FSDP2's TrainingState / ShardedState).

Each enum belongs to one class, which alone moves it; the transitions are drawn in docs/INTERNALS.md.
"""
from __future__ import annotations

from enum import Enum


class ShardedState(Enum):
    """`FlatParamHandle`: where the full flat parameter is."""

    SHARDED = "sharded"          # only this rank's shard; the full buffer's storage is freed
    UNSHARDING = "unsharding"    # all-gather in flight into the full buffer (wait_unshard before use)
    UNSHARDED = "unsharded"      # full buffer valid (always, for a handle whose leaf aliases its shard)


class TrainingState(Enum):
    """`Unit`: what the current step is doing with this unit."""

    IDLE = "idle"                    # between steps, or forward done and backward not reached yet
    FORWARD = "forward"              # inside the unit's forward (nested calls counted by Unit.depth)
    PRE_BACKWARD = "pre_backward"    # backward reached the unit's outputs: parameters unsharded for it
    POST_BACKWARD = "post_backward"  # backward passed the unit's inputs: the unit's gradients are done


class RootPhase(Enum):
    """`RootState`: the model-wide phase."""

    IDLE = "idle"
    BACKWARD = "backward"            # a backward is running and its end-of-backward callback is queued
    FULL_PARAMS = "full_params"      # inside fp.full_params(): sites hold full master parameters


class OrderState(Enum):
    """`RootState`: the execution order of units, used for prefetching."""

    RECORDING = "recording"          # first forward: units are appended (and checked equal on every rank)
    FROZEN = "frozen"                # after the first root forward: prefetch follows the recorded order


class ReduceWindow(Enum):
    """`Reduction` (``_reduce/reduction.py``): what backwards do with gradients."""

    SYNC = "sync"                    # reduce them in backward (the default)
    NO_SYNC = "no_sync"              # inside fp.no_sync(): accumulate unsharded gradients locally


class ReduceState(Enum):
    """`Reduction`: what is in flight."""

    IDLE = "idle"
    IN_FLIGHT = "in_flight"          # gradient reductions issued in this backward, some not finished
    AGREEING = "agreeing"            # end of backward: the unused-parameter mask all-reduce is issued
