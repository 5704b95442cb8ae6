"""Host (CPU) allocator settings for the engine's per-step buffers.

A ZeRO-3 step allocates and frees the same large buffers every step (each unit's full parameters, its flat
gradient, the reduction's chunks). On CUDA torch's caching allocator keeps freed blocks for the next request;
on the CPU every tensor is a ``malloc`` block, and glibc hands large freed blocks back to the kernel (``munmap``
above the mmap threshold, ``trim`` of the heap's top above the trim threshold), so the next step takes a page
fault per 4 KiB page to get them again. Measured on the small GPT at world 2 (benchmarks/profile_step.py):
4 000–16 000 minor faults per step and 30–50 ms of kernel CPU, against 0–3 000 and 9–18 ms for DDP, whose
buckets persist. Fixing both thresholds (glibc's own knobs, as ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` would) keeps up to ``_TRIM_BYTES`` of freed heap for reuse, like a caching
allocator: the live heap (what the memory targets count) does not change, only what the process keeps
mapped once it has freed it. Opt out with ``FSDP_PLUGIN_HOST_ALLOC=0``; a no-op without glibc or when the
user set glibc's variables.
"""
from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3      # glibc malloc.h
_MMAP_BYTES = 32 << 20     # glibc's maximum: blocks up to 32 MiB come from the heap and are reused
_TRIM_BYTES = 256 << 20    # freed heap kept for reuse before glibc returns it to the kernel
_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Apply the thresholds once per process; True when they are in effect."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("FSDP_PLUGIN_HOST_ALLOC", "1") == "0":
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False        # the user tuned glibc already
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False        # not glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))
