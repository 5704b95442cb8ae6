"""Parity protocol: same seed, different data per rank; every step compared against single-process
training on the global batch (and against DDP)."""
import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import fsdp_plugin as fp
from models import GPT, Block, gpt_batch

STEPS = 10


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # Adam turns float noise in near-zero gradients into +-lr steps (DDP drifts from one process
    # just as much), so its learning rate stays small enough for the 1e-5 parameter check to be fair.
    return torch.optim.AdamW(params, lr=2e-3, eps=1e-6, weight_decay=0.1)


def single_process(world, optim, steps=STEPS, model_fn=GPT, batch_fn=gpt_batch):
    """Losses and final state of one process training on the concatenation of every rank's batch."""
    torch.manual_seed(0)
    model = model_fn()
    opt = make_optimizer(optim, model.parameters())
    losses = []
    for s in range(steps):
        xs, ys = zip(*[batch_fn(s, r) for r in range(world)])
        loss = model(torch.cat(xs), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def global_mean(loss, world):
    """The loss averaged over ranks (every rank's batch has the same size)."""
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return t.item() / world


def train(model, opt, rank, world, steps, batch_fn=gpt_batch, first=0, each=None):
    """Run ``steps`` optimizer steps on this rank's batches; return the global mean loss of each step."""
    losses = []
    for s in range(first, first + steps):
        loss = model(*batch_fn(s, rank))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(global_mean(loss, world))
        if each is not None:
            each(s, loss)
    return losses


def sharded_worker(rank, world, strategy, optim, mesh=None, steps=STEPS, model_fn=GPT, batch_fn=gpt_batch,
                   policy=(Block,)):
    torch.manual_seed(0)
    model = model_fn()
    kwargs = {"device_mesh": mesh} if mesh else {}
    fp.shard(model, auto_wrap_policy=set(policy), sharding_strategy=strategy, **kwargs)
    opt = make_optimizer(optim, model.parameters())
    losses = train(model, opt, rank, world, steps, batch_fn)
    return losses, fp.full_state_dict(model)


def ddp_worker(rank, world, optim, steps=STEPS):
    torch.manual_seed(0)
    model = DistributedDataParallel(GPT())
    return train(model, make_optimizer(optim, model.parameters()), rank, world, steps)


def assert_close_losses(got, want, tol=1e-5):
    diffs = [abs(a - b) for a, b in zip(got, want)]
    assert len(got) == len(want) and max(diffs) <= tol, f"loss drift {max(diffs):.3e} > {tol}: {got} vs {want}"


def assert_close_state(got, want, tol=1e-5):
    assert list(got) == list(want), f"keys differ: {set(got) ^ set(want)}"
    for k in want:
        diff = (got[k].float() - want[k].float()).abs().max().item() if want[k].numel() else 0.0
        assert diff <= tol, f"{k}: max diff {diff:.3e}"


def same_casts_reference(world, steps, dtype=None, model_fn=GPT, batch_fn=gpt_batch, device="cpu"):
    """Mixed-precision reference in one process: fp32 master, each rank's batch run forward/backward on a
    ``dtype`` copy (None: the master itself), gradients averaged in fp32, SGD with momentum."""
    torch.manual_seed(0)
    master = model_fn().to(device)
    opt = make_optimizer("sgd", master.parameters())
    losses = []
    for s in range(steps):
        low = copy.deepcopy(master).to(dtype) if dtype else master
        total = [torch.zeros_like(p) for p in master.parameters()]
        step_loss = 0.0
        for r in range(world):
            low.zero_grad()
            loss = low(*(t.to(device) for t in batch_fn(s, r)))
            loss.backward()
            for acc, p in zip(total, low.parameters()):
                acc.add_(p.grad.float())
            step_loss += loss.float().item() / world
        for p, acc in zip(master.parameters(), total):
            p.grad = acc / world
        opt.step()
        losses.append(step_loss)
    return losses, master.state_dict()


def check_steps(got_by_rank, want, tol=1e-5):
    """Per step, every rank's ``(loss, {name: grad is None}, {name: full param})`` against one process's;
    full parameters are compared where a rank returned them (rank 0 must return every name)."""
    for rank, got in enumerate(got_by_rank):
        for s, ((loss, none, state), (wloss, wnone, wstate)) in enumerate(zip(got, want)):
            assert abs(loss - wloss) <= tol, f"rank {rank} step {s}: loss {loss} vs {wloss}"
            assert none == wnone, (f"rank {rank} step {s}: .grad is None differs for "
                                   f"{[n for n in wnone if none[n] != wnone[n]]}")
            if rank == 0:
                assert state.keys() == wstate.keys(), f"step {s}: parameters differ by name"
            for n, v in state.items():
                diff = (v - wstate[n]).abs().max().item()
                assert diff <= tol, f"rank {rank} step {s}: {n} off by {diff:.2e}"
