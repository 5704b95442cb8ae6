"""The CPU engine keeps freed per-step buffers for reuse (glibc thresholds), once per process, with opt-outs."""
from __future__ import annotations

import sys

import pytest

from fsdp_plugin._build import host_alloc as _host_alloc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_thresholds_applied_once_and_opt_outs(monkeypatch):
    for k in ("FSDP_PLUGIN_HOST_ALLOC", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
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
