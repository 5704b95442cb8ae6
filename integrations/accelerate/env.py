"""Environment handling around ``accelerate.Accelerator.__init__``."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

# Variables that would make stock accelerate build torch's FSDP plugin or an FSDP2 device mesh.
HIDDEN_DURING_INIT = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_PARALLELISM_CONFIG")


@contextlib.contextmanager
def hidden_env(names=HIDDEN_DURING_INIT) -> Iterator[None]:
    """Remove ``names`` from ``os.environ`` inside the block and restore them afterwards."""
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def launched_world_size() -> int:
    """``WORLD_SIZE`` set by torchrun / ``accelerate launch`` (1 when absent)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def needs_cpu_flag() -> bool:
    """Stock accelerate turns a torchrun-launched CPU job into N independent single-process jobs
    unless ``cpu=True`` is passed; do that when there is no CUDA and more than one process."""
    return not torch.cuda.is_available() and launched_world_size() > 1
