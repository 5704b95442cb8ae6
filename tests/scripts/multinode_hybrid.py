"""Run under torchrun as 2 "nodes" x 2 processes: hybrid_shard with no mesh must shard inside a node
(from LOCAL_WORLD_SIZE) and all-reduce across nodes, matching single-process training."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fsdp_plugin as fp  # noqa: E402
from _parity import assert_close_losses, assert_close_state, single_process, train  # noqa: E402
from models import GPT, Block  # noqa: E402


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, sharding_strategy="hybrid_shard")
    mesh = model._fp_root.mesh
    node = rank // local
    assert dist.get_process_group_ranks(mesh.shard_group) == list(range(node * local, (node + 1) * local))
    assert dist.get_process_group_ranks(mesh.replicate_group) == list(range(rank % local, world, local))
    losses = train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank, world, 6)
    state = fp.full_state_dict(model)
    if rank == 0:
        want_losses, want_state = single_process(world, "sgd", steps=6)
        assert_close_losses(losses, want_losses)
        assert_close_state(state, want_state)
        print(f"MULTINODE_OK world={world} shard_size={mesh.shard_size} replicate={mesh.replicate_size}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
