"""Run by .ci/run under torchrun (2 ranks) in a fresh venv holding only the built wheel, from an empty directory:
every public subpackage imports from the installed wheel, one sharded step trains, and a checkpoint round trip
restores the same parameters. Prints one line on rank 0; any failure exits non-zero."""
import importlib
import os
import sys

import torch
import torch.distributed as dist

import fsdp_plugin as fp

SUBPACKAGES = ["fsdp_plugin.checkpoint", "fsdp_plugin.planner", "fsdp_plugin.cli", "fsdp_plugin.integrations",
               "fsdp_plugin.integrations.lightning", "fsdp_plugin.integrations.lightning.strategy",
               "fsdp_plugin.integrations.accelerate", "fsdp_plugin.integrations.transformers"]


def main() -> None:
    if not fp.__file__.startswith(sys.prefix):
        sys.exit(f"fsdp_plugin was imported from {fp.__file__}, not from the installed wheel")
    for name in SUBPACKAGES:
        importlib.import_module(name)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)])
    fp.shard(model, fp.ShardingConfig(auto_wrap_policy={torch.nn.Linear}))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    path = os.path.join(sys.argv[1], "ckpt")
    fp.save_checkpoint(path, model, opt, extra={"step": 1})
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    extra = fp.load_checkpoint(path, model, opt)
    assert extra["step"] == 1, extra
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())), "round trip changed weights"
    if dist.get_rank() == 0:
        print(f"wheel smoke: {len(SUBPACKAGES)} subpackages imported from {os.path.dirname(fp.__file__)}; "
              f"2-rank step and checkpoint round trip ok")
    fp.shutdown()


if __name__ == "__main__":
    main()
