"""One process plays rank 0 of a world of any size under torch's fake process group (tests/test_fake_world.py).

    python tests/scripts/fake_world.py WORLD        # prints one JSON line per strategy

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


def main():
    world = int(sys.argv[1])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    with tempfile.TemporaryDirectory() as tmp:
        for strategy, mesh in meshes(world).items():
            print(json.dumps(row(world, strategy, mesh, tmp)), flush=True)
    fp.shutdown()


if __name__ == "__main__":
    main()
