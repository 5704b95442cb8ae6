"""Memory and traffic probes for CPU benchmark runs (Linux).

* heap: live and peak malloc bytes, counted by a tiny LD_PRELOAD interposer compiled on first use (needs a C
  compiler; otherwise heap numbers are -1). On CPU every tensor is one malloc block (c10's allocator calls
  posix_memalign), so this is the CPU analogue of ``torch.cuda.max_memory_allocated`` plus a few MB of
  non-tensor heap. It also sees memory held only in C++ (DDP buckets, gloo buffers).
* RSS and its high-water mark from /proc (the mark can be reset), which over-states live memory: glibc keeps
  freed blocks, and it includes ~300 MB of torch itself.
* bytes sent: ``wchar`` of /proc/self/io. gloo moves data with write/writev on TCP sockets, so during training
  steps (no file I/O) its delta is the bytes this rank put on the wire, for any backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

_C_SOURCE = r"""
#define _GNU_SOURCE
#include <malloc.h>
#include <stddef.h>
extern void *__libc_malloc(size_t); extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t); extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
static long long live_, peak_;
static void add_(void *p) {
  if (!p) return;
  long long v = __atomic_add_fetch(&live_, (long long)malloc_usable_size(p), __ATOMIC_RELAXED);
  long long pk = __atomic_load_n(&peak_, __ATOMIC_RELAXED);
  while (v > pk && !__atomic_compare_exchange_n(&peak_, &pk, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
}
static void sub_(void *p) { if (p) __atomic_sub_fetch(&live_, (long long)malloc_usable_size(p), __ATOMIC_RELAXED); }
void *malloc(size_t n) { void *p = __libc_malloc(n); add_(p); return p; }
void free(void *p) { sub_(p); __libc_free(p); }
void *calloc(size_t a, size_t b) { void *p = __libc_calloc(a, b); add_(p); return p; }
void *realloc(void *o, size_t n) {
  if (!o) return malloc(n);
  if (!n) { free(o); return 0; }
  long long before = (long long)malloc_usable_size(o);
  void *p = __libc_realloc(o, n);
  if (p) { __atomic_sub_fetch(&live_, before, __ATOMIC_RELAXED); add_(p); }
  return p;
}
void *memalign(size_t a, size_t n) { void *p = __libc_memalign(a, n); add_(p); return p; }
void *aligned_alloc(size_t a, size_t n) { return memalign(a, n); }
int posix_memalign(void **out, size_t a, size_t n) {
  void *p = __libc_memalign(a, n); if (!p) return 12; add_(p); *out = p; return 0;
}
void *valloc(size_t n) { return memalign(4096, n); }
void *pvalloc(size_t n) { return memalign(4096, (n + 4095) & ~(size_t)4095); }
long long bench_heap_live(void) { return __atomic_load_n(&live_, __ATOMIC_RELAXED); }
long long bench_heap_peak(void) { return __atomic_load_n(&peak_, __ATOMIC_RELAXED); }
long long bench_heap_reset_peak(void) {
  long long v = __atomic_load_n(&live_, __ATOMIC_RELAXED); __atomic_store_n(&peak_, v, __ATOMIC_RELAXED); return v;
}
"""


def build_heap_tracker() -> str | None:
    """Compile the interposer into a temp folder (cached by source hash); its path, or None without a compiler."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    tag = hashlib.sha1(_C_SOURCE.encode()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"fsdp_plugin_bench_{os.getuid()}" / f"libheaptrack_{tag}.so"
    if out.exists():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.with_suffix(f".{os.getpid()}.c")
    src.write_text(_C_SOURCE)
    tmp = out.with_suffix(f".{os.getpid()}.so")
    try:
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(src)], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        return None
    finally:
        src.unlink(missing_ok=True)
    os.replace(tmp, out)
    return str(out)


class Heap:
    """Reads the interposer's counters; ``available`` is False when it was not preloaded."""

    def __init__(self) -> None:
        self.available = False
        if "libheaptrack" not in os.environ.get("LD_PRELOAD", ""):
            return
        try:
            lib = ctypes.CDLL(None)
            for f in ("bench_heap_live", "bench_heap_peak", "bench_heap_reset_peak"):
                getattr(lib, f).restype = ctypes.c_longlong
        except (OSError, AttributeError):
            return
        self._lib, self.available = lib, True

    def live(self) -> int:
        return self._lib.bench_heap_live() if self.available else -1

    def peak(self) -> int:
        return self._lib.bench_heap_peak() if self.available else -1

    def reset_peak(self) -> int:
        return self._lib.bench_heap_reset_peak() if self.available else -1


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return -1


def rss() -> int:
    return _status("VmRSS:")


def rss_peak() -> int:
    return _status("VmHWM:")


def reset_rss_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def bytes_sent() -> int:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    total = sum(v[:8])
    return total - v[3] - v[4], total


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return -1
