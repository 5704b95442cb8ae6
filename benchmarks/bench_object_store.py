"""Checkpoints on a local S3 API server (moto, its own process) vs local disk vs torch DCP's FsspecWriter/Reader.

    python benchmarks/bench_object_store.py [--mb 256] [--repeats 2]

Same run, same model (fp32 ``nn.Linear(2048, 2048)`` layers, ``--mb`` MiB of weights), one process:
fsdp_plugin save/load to a local directory, fsdp_plugin save/load to ``s3://`` on the server (s3fs), DCP
``dcp.save``/``dcp.load`` with ``FsspecWriter``/``FsspecReader`` to the same server. Then an N→M check: save at
world 2, load at world 3 (forked ranks), and print each rank's ranged-read bytes next to the bytes it needs.
Timings depend on the machine's load (printed); byte counts do not.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


#: botocore read timeout for the benchmark's client (seconds): longer than moto's slowest multipart completion.
READ_TIMEOUT_S = 900


def _serve(port: int) -> None:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    s = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    s.start()
    while True:
        time.sleep(3600)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(mb: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(max(1, mb // 16))])


def _timed(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _ours(path: str, mb: int, repeats: int) -> tuple[float, float]:
    import fsdp_plugin as fp

    m = fp.shard(_model(mb))
    save = _timed(lambda: fp.save_checkpoint(path, m), repeats)
    m2 = fp.shard(_model(mb, 1))
    load = _timed(lambda: fp.load_checkpoint(path, m2), repeats)
    with fp.full_params(m), fp.full_params(m2):
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
    return save, load


def _dcp(url: str, mb: int, repeats: int) -> tuple[float, float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    m = _model(mb)
    n = [0]

    def save():
        n[0] += 1
        dcp.save(m.state_dict(), storage_writer=FsspecWriter(f"{url}-{n[0]}"))

    s = _timed(save, repeats)
    m2 = _model(mb, 1)
    sd = m2.state_dict()
    load = _timed(lambda: dcp.load(sd, storage_reader=FsspecReader(f"{url}-{n[0]}")), repeats)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), sd.values()))
    return s, load


def _save_rank(rank, world, path, mb):
    import fsdp_plugin as fp

    fp.save_checkpoint(path, fp.shard(_model(mb)))


def _load_rank(rank, world, path, mb):
    import fsdp_plugin as fp
    from fsdp_plugin._flat.layout import param_shards
    from fsdp_plugin.checkpoint.storage import remote

    m = fp.shard(_model(mb, 1))
    before = remote.bytes_read
    fp.load_checkpoint(path, m)
    return sum((sh.end - sh.start) * 4 for sh in param_shards(m)), remote.bytes_read - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    port = _free_port()
    server = mp.get_context("spawn").Process(target=_serve, args=(port,), daemon=True)
    server.start()
    # A read timeout longer than moto's slowest multipart completion: moto assembles the object in its request
    # thread (every part copied, then an MD5), which at 256 MiB on a loaded machine outlasted botocore's 60 s
    # default. The client (botocore, and s3fs, which retries read timeouts itself) then re-sent
    # CompleteMultipartUpload while the first completion still ran; when one completion stores the object, moto
    # disposes the parts the other is still reading: "seek of closed file" (reproduced with a 3 s completion and
    # a 1 s timeout, with or without AWS_MAX_ATTEMPTS=1). botocore's own retries are off as in the tests;
    # fsdp_plugin's bounded retries (a whole re-upload) stay on.
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1", AWS_MAX_ATTEMPTS="1")
    import fsspec
    import s3fs

    fsspec.config.conf.setdefault("s3", {})["config_kwargs"] = {"read_timeout": READ_TIMEOUT_S,
                                                                 "connect_timeout": 60}

    for _ in range(100):
        try:
            s3fs.S3FileSystem().mkdir("bench")
            break
        except Exception:  # noqa: BLE001 - the server is starting
            time.sleep(0.1)
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp(prefix="bench_os_")
    try:
        rows = {"local disk (ours)": _ours(os.path.join(tmp, "ck"), args.mb, args.repeats),
                "s3 server (ours)": _ours("s3://bench/ours", args.mb, args.repeats),
                "s3 server (DCP FsspecWriter/Reader)": _dcp("s3://bench/dcp", args.mb, args.repeats)}
        print(f"load average {os.getloadavg()}; {args.mb} MiB fp32, best of {args.repeats}")
        print("| where | save s | load s | save MB/s | load MB/s |\n|---|---|---|---|---|")
        for k, (s, ld) in rows.items():
            print(f"| {k} | {s:.2f} | {ld:.2f} | {args.mb / s:.0f} | {args.mb / ld:.0f} |")
        from _dist import run_ranks

        run_ranks(_save_rank, 2, "s3://bench/n2m", args.mb, timeout=600)
        got = run_ranks(_load_rank, 3, "s3://bench/n2m", args.mb, timeout=600)
        print("N->M 2->3: per rank (needed bytes, ranged-read bytes incl. headers + manifest):",
              json.dumps(got))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        server.terminate()


if __name__ == "__main__":
    main()
