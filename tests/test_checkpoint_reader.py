"""Randomized tests of the exact-range reader: coalescing, CRC-block widening, bounce/cast runs."""
from __future__ import annotations

import os
import random

import pytest
import torch

from fsdp_plugin.checkpoint import CorruptCheckpointError
from fsdp_plugin.checkpoint.format import reader
from fsdp_plugin.checkpoint.format.writer import write_safetensors


@pytest.mark.parametrize("seed", range(6))
def test_random_ranged_reads_match_slices(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    monkeypatch.setattr(reader, "BOUNCE_BYTES", rng.choice([64, 4096, 1 << 20]))
    monkeypatch.setattr(reader, "WINDOW_BYTES", rng.choice([1, 700, 5000, 16 << 20]))  # pipelined CRC windows
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]
    tensors = []
    for i in range(rng.randint(1, 12)):
        dt = rng.choice(dtypes)
        n = rng.choice([0, 1, 7, 100, 3000])
        t = (torch.randn(n) * 100).to(dt) if dt.is_floating_point else torch.randint(0, 100, (n,)).to(dt)
        tensors.append((f"t{i}", t, (n,)))
    block = rng.choice([64, 512, 4096, 1 << 20])
    path = tmp_path / "f.safetensors"
    rec = write_safetensors(str(path), tensors, {"format": "pt"}, block_bytes=block).to_json()
    plan = reader.ReadPlan(str(tmp_path), {"f.safetensors": rec})
    header = plan.header("f.safetensors")
    checks = []
    for name, t, _ in tensors:
        for _ in range(rng.randint(0, 3)):
            if t.numel() == 0:
                continue
            a = rng.randrange(t.numel())
            b = rng.randint(a, t.numel())
            cast = rng.random() < 0.3
            dest = torch.zeros(b - a, dtype=torch.float64 if cast else t.dtype)
            e = header.entries[name]
            plan.add("f.safetensors", e.begin + a * t.element_size(), t.dtype, dest, name)
            checks.append((dest, t[a:b]))
    plan.execute()
    plan.close()
    for dest, ref in checks:
        assert torch.equal(dest, ref.to(dest.dtype))
    assert plan.bytes_read <= os.path.getsize(path) * max(1, len(checks))


def test_crc_failure_names_block_and_tensor(tmp_path):
    t = torch.arange(4096, dtype=torch.float32)
    path = tmp_path / "f.safetensors"
    rec = write_safetensors(str(path), [("x", t, (4096,))], None, block_bytes=1024).to_json()
    with open(path, "r+b") as f:
        f.seek(rec["data_start"] + 5000)
        f.write(b"\xff")
    plan = reader.ReadPlan(str(tmp_path), {"f.safetensors": rec})
    e = plan.header("f.safetensors").entries["x"]
    plan.add("f.safetensors", e.begin, torch.float32, torch.zeros(10), "x")  # block 4 only: fine
    plan.execute()
    plan.add("f.safetensors", e.begin + 4800, torch.float32, torch.zeros(100), "x")
    with pytest.raises(CorruptCheckpointError, match=r"block 8 \(bytes 8,192-9,216\).*tensors x"):
        plan.execute()
    plan.close()


@pytest.mark.parametrize("window", [1024, 3000, 1 << 20])
def test_crc_failure_found_in_any_window(tmp_path, monkeypatch, window):
    """A whole-file read split into windows (CRC on a helper thread) still names the corrupted block."""
    monkeypatch.setattr(reader, "WINDOW_BYTES", window)
    t = torch.arange(8192, dtype=torch.float32)
    path = tmp_path / "f.safetensors"
    rec = write_safetensors(str(path), [("x", t, (8192,))], None, block_bytes=1024).to_json()
    plan = reader.ReadPlan(str(tmp_path), {"f.safetensors": rec})
    e = plan.header("f.safetensors").entries["x"]
    dest = torch.zeros(8192)
    plan.add("f.safetensors", e.begin, torch.float32, dest, "x")
    plan.execute()
    assert torch.equal(dest, t)
    with open(path, "r+b") as f:
        f.seek(rec["data_start"] + 20000)
        f.write(b"\xff")
    plan.add("f.safetensors", e.begin, torch.float32, dest, "x")
    with pytest.raises(CorruptCheckpointError, match=r"block 23 \(bytes 23,552-24,576\).*tensors x"):
        plan.execute()
    plan.close()


def test_fast_crc32_matches_zlib():
    """fsio.crc32 (libdeflate when installed) is zlib's CRC-32, chained, on any buffer it may get."""
    import zlib

    from fsdp_plugin.checkpoint.storage import fsio

    t = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    view = fsio.byte_view(t)
    for lo, hi in [(0, 0), (0, 100), (1, 70000), (12345, 3 << 20)]:
        assert fsio.crc32(view[lo:hi], 7) == zlib.crc32(view[lo:hi], 7)
    assert fsio.crc32(memoryview(bytes(view[:100000]))) == zlib.crc32(view[:100000])  # read-only: zlib
    f32 = memoryview(t.view(torch.float32).numpy())  # not a byte view: nbytes, not len
    assert fsio.crc32(f32) == zlib.crc32(view)
    if os.path.exists("/usr/lib/x86_64-linux-gnu/libdeflate.so.0") and not os.environ.get("FSDP_PLUGIN_ZLIB_CRC32"):
        assert fsio._DEFLATE_CRC32 is not None, "libdeflate is installed but not used"
    crc = fsio.BlockCrc(1 << 20)
    crc.update(view[:1500000])
    crc.update(view[1500000:])
    assert crc.finish() == [zlib.crc32(view[i:i + (1 << 20)]) for i in range(0, 3 << 20, 1 << 20)]
