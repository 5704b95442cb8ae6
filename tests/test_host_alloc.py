"""The CPU engine keeps freed per-step buffers for reuse (glibc thresholds), once per process, with opt-outs."""
from __future__ import annotations

import sys

import pytest

from fsdp_plugin._build import host_alloc as _host_alloc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_thresholds_applied_once_and_opt_outs(monkeypatch):
    for k in ("FSDP_PLUGIN_HOST_ALLOC",) + _host_alloc._USER_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(_host_alloc, "_applied", None)
    assert _host_alloc.keep_freed_host_memory() is True
    calls = []
    monkeypatch.setattr(_host_alloc, "_apply", lambda: calls.append(1) or True)
    assert _host_alloc.keep_freed_host_memory() is True and not calls, "applied once per process"
    monkeypatch.undo()
    monkeypatch.setenv("FSDP_PLUGIN_HOST_ALLOC", "0")
    assert _host_alloc._apply() is False
    monkeypatch.delenv("FSDP_PLUGIN_HOST_ALLOC")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000000")
    assert _host_alloc._apply() is False, "the user's own glibc tuning wins"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "65536")
    assert _host_alloc._apply() is False, "the user's own glibc tuning wins"


def _big_block_faults() -> list:
    import resource

    import torch
    from fsdp_plugin._build import host_alloc
    assert host_alloc.keep_freed_host_memory()
    faults = []
    for _ in range(8):       # 64 MiB, above any mmap threshold glibc takes, allocated and freed 8 times
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(64 << 20, dtype=torch.uint8)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return faults


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_above_32_mib_is_reused_not_faulted_back():
    import multiprocessing as mp
    with mp.get_context("spawn").Pool(1) as pool:   # a fresh process: mallopt is process-wide
        faults = pool.apply(_big_block_faults)
    # without the settings every 64 MiB block is a fresh mapping: 16 384 faults of 4 KiB each time; with them the
    # heap grows in the first two or three (measured) and then hands the same block back
    assert sum(faults[4:]) < 1000, faults
