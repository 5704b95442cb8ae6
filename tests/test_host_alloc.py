"""The CPU engine keeps freed per-step buffers for reuse (glibc thresholds), once per process, with an opt-out."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHECK = ("from fsdp_plugin import _host_alloc as h; first = h.keep_freed_host_memory(); "
         "print(first, h.keep_freed_host_memory() is first)")


def _run(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "FSDP_PLUGIN_HOST_ALLOC"))}
    r = subprocess.run([sys.executable, "-c", CHECK], env={**clean, **env}, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_thresholds_applied_once_and_opt_outs():
    assert _run() == "True True"
    assert _run(FSDP_PLUGIN_HOST_ALLOC="0") == "False True"
    assert _run(MALLOC_TRIM_THRESHOLD_="1000000") == "False True", "the user's own glibc tuning wins"
