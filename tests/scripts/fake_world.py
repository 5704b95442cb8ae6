"""One process plays rank 0 of a world of any size under torch's fake process group (tests/test_fake_world.py).

    python tests/scripts/fake_world.py WORLD                # prints one JSON line per strategy
    python tests/scripts/fake_world.py WORLD --host-waits   # host waits per training step instead (issue 48)

For each strategy: fp.shard, two AdamW training steps, fp.save_checkpoint, fp.plan of the same job; the row holds
this rank's real parameter-shard and optimizer-state bytes beside the plan's. No patching of the engine.
"""
import json
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fsdp_plugin as fp  # noqa: E402
from models import GPT, Block, gpt_batch  # noqa: E402

SIZE = dict(vocab=64, d=32, n_layer=2, seq=16)


def meshes(world):
    """hybrid's (replicate, shard): nodes of 8 ranks (4 at world 8, so that both dimensions are > 1)."""
    shard = 4 if world <= 8 else 8
    return {"full_shard": None, "shard_grad_op": None, "no_shard": None, "hybrid_shard": (world // shard, shard)}


def row(world, strategy, mesh, tmp):
    torch.manual_seed(0)
    cfg = fp.ShardingConfig(auto_wrap_policy={Block}, sharding_strategy=strategy, device_mesh=mesh)
    model = fp.shard(GPT(**SIZE), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(2):
        model(*gpt_batch(s, 0, batch=2, seq=16, vocab=SIZE["vocab"])).backward()
        opt.step()
        opt.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp.save_checkpoint(os.path.join(tmp, strategy), model, opt)
    root = model._fp_root
    params = sum(h.flat_shard.numel() * h.flat_shard.element_size() for u in root.units for h in u.handles)
    # AdamW's moments (its per-tensor ``step`` scalars are not counted by the plan: 4 bytes per tensor)
    moments = sum(t.numel() * t.element_size() for st in opt.state.values() for k, t in st.items()
                  if torch.is_tensor(t) and k != "step")
    w = fp.plan(lambda: GPT(**SIZE), world, cfg, batch_size=2, seq_len=16).worlds[world]
    return {"world": world, "strategy": strategy, "shard": root.mesh.shard_size,
            "replicate": root.mesh.replicate_size, "pairing": root.pairing, "param_bytes": params,
            "moment_bytes": moments, "plan_param_bytes": w.param_shards, "plan_optimizer_bytes": w.optimizer_state,
            "save_warning": "; ".join(str(c.message) for c in caught)}


class ValueReads:
    """Counts the engine's reads of tensor values (``item``/``tolist``/``cpu``/``numpy``: each one a host sync when
    the tensor is on a GPU) by call site, and every ``torch.cuda`` synchronization, while active."""

    METHODS = ("item", "tolist", "cpu", "numpy")

    def __init__(self):
        self.sites, self._saved = {}, {}

    def _wrap(self, name, fn):
        def counted(*a, **k):
            frame = sys._getframe(1)
            if frame.f_globals.get("__name__", "").startswith("fsdp_plugin"):
                site = f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_lineno} {name}"
                self.sites[site] = self.sites.get(site, 0) + 1
            return fn(*a, **k)
        return counted

    def __enter__(self):
        for name in self.METHODS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(name, self._saved[name]))
        self._saved["synchronize"] = torch.cuda.synchronize
        torch.cuda.synchronize = self._wrap("cuda.synchronize", lambda *a, **k: None)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize = self._saved.pop("synchronize")
        for name, fn in self._saved.items():
            setattr(torch.Tensor, name, fn)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_waits(world, strategy, mesh):
    """Per training step (after a first one): waits that passed a deadline to the backend, deliberate host
    polls, waits handed to the deadline monitor, and the engine's value reads by call site."""
    from fsdp_plugin._comm import collectives as comm
    torch.manual_seed(0)
    cfg = fp.ShardingConfig(auto_wrap_policy={Block}, sharding_strategy=strategy, device_mesh=mesh)
    model = fp.shard(GPT(**SIZE), cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = []
    for s in range(3):
        fp.sync_stats.reset()
        watched = comm.MONITOR.watched
        with ValueReads() as reads:
            loss = model(*gpt_batch(s, 0, batch=2, seq=16, vocab=SIZE["vocab"]))
            loss.backward()
            opt.step()
            opt.zero_grad()
        rows.append({"timed": dict(fp.sync_stats.timed), "host": dict(fp.sync_stats.host),
                     "watched": comm.MONITOR.watched - watched, "reads": reads.sites})
    # where a CUDA root's unused-parameter masks travel (the one value the engine reads in a step): host tensors
    from fsdp_plugin._reduce.usage import UsageAgreement
    root = model._fp_root
    root.device, cpu = torch.device("cuda"), root.device
    try:
        agreement = UsageAgreement(root)
        mask_device = agreement.flat.device.type if agreement.flat is not None else None
        agreement.drain()
    finally:
        root.device = cpu
    return {"world": world, "strategy": strategy, "steps": rows[1:], "cuda_mask_device": mask_device}


def main():
    world = int(sys.argv[1])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, mesh in meshes(world).items():
            if "--host-waits" in sys.argv:
                print(json.dumps(host_waits(world, strategy, mesh)), flush=True)
            else:
                print(json.dumps(row(world, strategy, mesh, tmp)), flush=True)
    fp.shutdown()


if __name__ == "__main__":
    main()
