"""Under torchrun: the README's nccl_sim recipe, as a user runs it (issue 53): init_process_group("nccl_sim"), shard,
train; the last step blocks the host nowhere. Prints NCCL_SIM_OK <rank> <loss>."""
import torch
import torch.distributed as dist

import fsdp_plugin as fp
import fsdp_plugin.testing as fpt
from models import GPT, Block, gpt_batch

dist.init_process_group("nccl_sim")
rank = dist.get_rank()
assert dist.get_backend() == "nccl_sim"
torch.manual_seed(0)
model = fp.shard(GPT(), auto_wrap_policy={Block})
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    fpt.COUNTERS.reset()
    loss = model(*gpt_batch(step, rank))
    opt.zero_grad()
    loss.backward()
    opt.step()
assert fpt.COUNTERS.host == {}, fpt.COUNTERS.host
assert sum(fpt.COUNTERS.issued.values()) > 0
print(f"NCCL_SIM_OK {rank} {loss.item():.6f}", flush=True)
fp.shutdown()
