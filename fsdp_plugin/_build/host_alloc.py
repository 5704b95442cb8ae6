"""Host (CPU) allocator settings for the engine's per-step buffers.

A ZeRO-3 step allocates and frees the same large buffers every step (each unit's full parameters, its flat
gradient, the reduction's chunks, the logits and their gradient). On CUDA torch's caching allocator keeps freed
blocks for the next request; on the CPU every tensor is a ``malloc`` block, and glibc hands large freed blocks
back to the kernel (``munmap`` of every block above the mmap threshold, at most 32 MiB; ``trim`` of the heap's
top above the trim threshold), so the next step takes a page fault per 4 KiB page to get them again, the kernel
zeroing each one. Measured on the medium GPT (110 M) at world 2, no_shard (benchmarks/RESULTS_lab_notes.md § 30d): with
the mmap threshold at 32 MiB and 256 MiB kept, 150 000–200 000 faults and 0.6–0.7 s of kernel CPU per 2.3 s step
(the tied embedding's 100 MB gradient, the logits, the optimizer's temporaries: all above 32 MiB); with every
block served from the heap (``M_MMAP_MAX`` 0) and 1 GiB of freed heap kept, 10–5 000 faults, 0.23 s, a 1.9 s
step. glibc's own knobs (as ``MALLOC_MMAP_MAX_`` / ``MALLOC_TRIM_THRESHOLD_`` would set them), like a caching
allocator: the live heap (what the memory targets count) does not change, only what the process keeps mapped
once it has freed it (at most ``_TRIM_BYTES`` above the heap's live top). Opt out with
``FSDP_PLUGIN_HOST_ALLOC=0``; a no-op without glibc or when the user set glibc's variables.
"""
from __future__ import annotations

import ctypes
import os

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4      # glibc malloc.h
_TRIM_BYTES = 1 << 30      # freed heap kept for reuse before glibc returns it to the kernel
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_MAX_", "MALLOC_TOP_PAD_")
_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _applied
    if _applied is None:
        _applied = _apply()
    return _applied


def _apply() -> bool:
    if os.environ.get("FSDP_PLUGIN_HOST_ALLOC", "1") == "0":
        return False
    if any(k in os.environ for k in _USER_VARS):
        return False        # the user tuned glibc already
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False        # not glibc
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # every block from the heap (threads' arenas still map what their heaps cannot hold), so freed blocks of
    # any size are reused; the heap's free top is returned to the kernel only beyond _TRIM_BYTES
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES))
