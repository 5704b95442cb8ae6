"""The torchrun ``--max-restarts`` recovery recipe, as a test script (tests/test_restart.py).

    torchrun --standalone --nproc-per-node 2 --max-restarts 3 tests/scripts/restart_train.py ROOT [KILL]

Every start resumes from ``fp.latest_checkpoint(ROOT/ckpt)`` (none: a fresh start), trains to STEPS with a
checkpoint every EVERY steps, and rank 0 writes the final full state to ROOT/final.safetensors. KILL =
``rank:step`` SIGKILLs that rank just before that step's forward; ``rank:step:save`` in the middle of that
step's checkpoint save (after its first collectives); ``rank:step:agent`` kills its torchrun agent too. A marker file makes the kill happen on the first start only.
"""
import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import fsdp_plugin as fp  # noqa: E402
from fsdp_plugin.checkpoint import save as _save  # noqa: E402
from models import GPT, Block, gpt_batch  # noqa: E402

STEPS, EVERY = 12, 3


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def arm_kill(root: str, spec: str, rank: int):
    """(step, in_save) of this rank's kill on the first start, else None. ``rank:step:agent`` also kills this
    worker's torchrun agent first (a node lost, for elastic runs)."""
    if not spec or os.path.exists(os.path.join(root, "killed")):
        return None
    who, step, *where = spec.split(":")
    if who != "any" and int(who) != rank:      # "any": this launcher's worker, whatever its rank
        return None
    if where == ["agent"]:
        global _die
        _die = _die_with_agent
        return int(step), False
    return int(step), bool(where)


def _die_with_agent():
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    torch.set_num_threads(1)
    root, spec = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))   # a failed rendezvous fails, never hangs
    rank = dist.get_rank()
    kill = arm_kill(root, spec, rank)
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, timeout_s=30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpts = os.path.join(root, "ckpt")
    latest = fp.latest_checkpoint(ckpts)                      # the whole recipe: two lines
    start = fp.load_checkpoint(latest, model, opt)["step"] if latest else 0
    print(f"rank {rank} of {dist.get_world_size()} starts at step {start + 1} from {latest}", flush=True)
    for step in range(start + 1, STEPS + 1):
        if kill == (step, False):
            open(os.path.join(root, "killed"), "w").close()
            _die()
        x, y = gpt_batch(step, rank)
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        if step % EVERY == 0:
            if kill == (step, True):
                open(os.path.join(root, "killed"), "w").close()
                _save._write_files = lambda *a, **k: _die()
            fp.save_checkpoint(os.path.join(ckpts, f"step{step:03d}"), model, opt, extra={"step": step})
    state = fp.full_state_dict(model)
    if rank == 0:
        save_file({k: v.clone() for k, v in state.items()}, os.path.join(root, "final.safetensors"))
    fp.shutdown()


if __name__ == "__main__":
    main()
