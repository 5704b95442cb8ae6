"""Bytes per step per mesh dimension and per-rank shard bytes, 2 dp x 2 tp against 4 x 1 (issue 31).

Load-independent counts: ``fp.comm_stats`` (the engine's own collectives, all on dp groups) per step and the
bytes of every rank's flat shards (parameters; gradients and AdamW state are the same per element). The TP
dimension's traffic is torch's own (DTensor functional collectives: rowwise outputs all-reduced in forward,
colwise inputs' gradients in backward), not counted by ``fp.comm_stats``: counted here at dispatch on the TP group.
Each row also prints ``fp.plan``'s prediction (``tp_size=``/``tp_plan=``) beside the measurement.
Run: ``python benchmarks/tp_bytes.py [--dim 256 --layers 4]`` (forks 4 gloo ranks)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fsdp_plugin as fp  # noqa: E402
from _dist import run_ranks  # noqa: E402
from _tp_export import _TPTraffic  # noqa: E402


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def model(d, layers):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(layers)])


def worker(rank, world, tp, d, layers):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    m = model(d, layers)
    if tp > 1:
        mesh = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh["tp"], {f"{i}.{n}": s for i in range(layers)
                                           for n, s in (("up", ColwiseParallel()), ("down", RowwiseParallel()))})
        fp.shard(m, device_mesh=mesh["dp"], auto_wrap_policy={Block})
    else:
        fp.shard(m, auto_wrap_policy={Block})
    x = torch.randn(8, 16, d, generator=torch.Generator().manual_seed(rank // tp))
    m(x).square().mean().backward()          # warm-up step (first forward records the order)
    fp.comm_stats.reset()
    traffic = _TPTraffic(mesh["tp"].get_group()) if tp > 1 else None
    with traffic.mode if traffic else contextlib.nullcontext():
        m(x).square().mean().backward()
    shard = sum(h.chunk * h.dtype.itemsize for u in m._fp_root.units for h in u.handles)
    return {"dp_bytes": dict(fp.comm_stats.bytes), "tp_bytes": traffic.bytes if traffic else {},
            "shard_bytes": shard}


def planned(tp, d, layers) -> dict:
    """fp.plan's prediction for the same job (the model before parallelize_module, world 4)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {f"{i}.{n}": s for i in range(layers) for n, s in (("up", ColwiseParallel()), ("down", RowwiseParallel()))}
    kw = {"tp_size": tp, "tp_plan": plan} if tp > 1 else {}
    w = fp.plan(lambda: model(d, layers), world_size=4, auto_wrap_policy={Block},
                inputs=lambda: torch.randn(8, 16, d), loss_fn=lambda y: y.square().mean(), **kw).worlds[4]
    return {"dp_bytes": w.wire_bytes, "tp_bytes": w.tp_wire_bytes, "shard_bytes": w.param_shards}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    for tp in (1, 2):
        r = run_ranks(worker, 4, tp, a.dim, a.layers, timeout=600)[0]
        print(json.dumps({"layout": f"{4 // tp}x{tp}", "measured": r, "planned": planned(tp, a.dim, a.layers)}))


if __name__ == "__main__":
    main()
