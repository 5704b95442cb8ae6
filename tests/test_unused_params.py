"""Parameters that get no gradient in a step behave as in single-process PyTorch (and DDP).

Unused on every rank -> ``p.grad`` stays None (or keeps its accumulated value) and the optimizer skips it;
used on some ranks only (data-dependent routing) -> the average over ranks, unused ranks adding zero.
Checked every step against one process on the global batch: loss, ``.grad is None`` per parameter on every
rank, and every parameter (<= 1e-5), with SGD-momentum and AdamW, under every strategy and world 1-4.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import check_steps as check, global_mean, make_optimizer

D, E, STEPS = 8, 6, 6


class Mlp(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.a, self.b = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class CondNet(nn.Module):
    """``branch`` (inside the root unit) runs when ``flags[0]``; ``extra`` (a unit of its own) when ``flags[1]``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Mlp() for _ in range(2))
        self.branch = nn.Linear(D, D)
        self.extra = Mlp()
        self.head = nn.Linear(D, 3)

    def forward(self, x, y, flags):
        h = self.inp(x)
        for blk in self.blocks:
            h = blk(h)
        if flags[0]:
            h = h + self.branch(h)
        if flags[1]:
            h = self.extra(h)
        return F.mse_loss(self.head(h), y)


class MoE(nn.Module):
    """Top-1 mixture: the router's probability scales the chosen expert; ``route`` (data) picks the expert, so
    routing differs per rank and per step; experts that get no token are not called (Mixtral's pattern)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(D, E)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x, route):
        prob = torch.softmax(self.router(x), dim=-1).gather(1, route[:, None])
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero().flatten()
            if idx.numel():
                out = out.index_add(0, idx, prob[idx] * expert(x[idx]))
        return x + out


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = nn.ModuleList(MoE() for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x, y, route):
        h = self.inp(x)
        for layer in self.moe:
            h = layer(h, route)
        return F.mse_loss(self.head(h), y)


def cond_batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    flags = (step % 2 == 0, step % 3 == 0) if micro == 0 else (step % 3 == 1, step % 4 == 1)
    return torch.randn(4, D, generator=g), torch.randn(4, 3, generator=g), flags


def moe_batch(step, rank, micro=0):
    g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    # rank r sends its tokens to experts (step + 2r) % E and, on odd steps, also the next one
    route = torch.tensor([(step + micro + 2 * rank + (t % 2) * (step % 2)) % E for t in range(4)])
    return torch.randn(4, D, generator=g), torch.randn(4, 3, generator=g), route


SCENARIOS = {"cond": (CondNet, cond_batch, (Mlp,)), "moe": (MoENet, moe_batch, (MoE,))}


def _global(batches):
    xs, ys, extra = zip(*batches)
    extra = extra[0] if isinstance(extra[0], tuple) else torch.cat(extra)
    return torch.cat(xs), torch.cat(ys), extra


def _grad_none(model):
    return {n: p.grad is None for n, p in model.named_parameters()}


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference(scenario, world, optim, micro=1):
    """One process on the global batch: per step the loss, which grads are None, and the parameters."""
    model_fn, batch_fn, _ = SCENARIOS[scenario]
    torch.manual_seed(0)
    model = model_fn()
    opt = make_optimizer(optim, model.parameters())
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss_sum = 0.0
        for m in range(micro):
            loss = model(*_global([batch_fn(s, r, m) for r in range(world)])) / micro
            loss.backward()
            loss_sum += loss.item()
        out.append((loss_sum, _grad_none(model)))
        opt.step()
        out[-1] += (_params(model),)
    return out


def sharded(rank, world, scenario, strategy, optim, mesh, micro=1, use_no_sync=False, recompute=False):
    model_fn, batch_fn, policy = SCENARIOS[scenario]
    torch.manual_seed(0)
    model = model_fn()
    fp.shard(model, auto_wrap_policy=set(policy), sharding_strategy=strategy,
             activation_checkpointing=set(policy) if recompute else None, **({"device_mesh": mesh} if mesh else {}))
    opt = make_optimizer(optim, model.parameters())
    out = []
    for s in range(STEPS):
        opt.zero_grad()
        loss_sum = 0.0
        for m in range(micro):
            quiet = use_no_sync and m < micro - 1
            with fp.no_sync(model) if quiet else _nothing():
                loss = model(*batch_fn(s, rank, m)) / micro
                loss.backward()
            loss_sum += global_mean(loss, world)
        out.append((loss_sum, _grad_none(model)))
        opt.step()
        out[-1] += ({k: v for k, v in fp.full_state_dict(model).items() if k in out[-1][1]},)
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_reference_exercises_unused_parameters():
    """The scenarios are not vacuous: some parameter has no gradient in some step, and optimizing it anyway
    (a zero gradient, as the flat buffer would give) changes the result."""
    for scenario in SCENARIOS:
        steps = reference(scenario, 2, "adamw")
        assert any(any(none.values()) for _, none, _ in steps), scenario
        assert any(not any(none.values()) for _, none, _ in steps) or scenario == "moe"


def test_check_can_fail():
    want = reference("cond", 1, "sgd")
    wrong = [(loss, {n: False for n in none}, state) for loss, none, state in want]
    with pytest.raises(AssertionError):
        check([wrong], want)


FAST = [
    ("cond", 1, "full_shard", "sgd", None), ("cond", 2, "full_shard", "adamw", None),
    ("cond", 3, "no_shard", "sgd", None), ("moe", 2, "shard_grad_op", "sgd", None),
    ("moe", 3, "full_shard", "adamw", None), ("moe", 4, "hybrid_shard", "adamw", (2, 2)),
]


@pytest.mark.parametrize("scenario,world,strategy,optim,mesh", FAST)
def test_unused_parameters_match_single_process(scenario, world, strategy, optim, mesh):
    results = run_ranks(sharded, world, scenario, strategy, optim, mesh, timeout=120)
    check(results, reference(scenario, world, optim))


def test_unused_parameters_under_activation_checkpointing():
    """Recomputed forwards make new views in backward; usage still comes from the views that reached the loss."""
    results = run_ranks(sharded, 2, "moe", "full_shard", "adamw", None, 1, False, True, timeout=120)
    check(results, reference("moe", 2, "adamw"))


@pytest.mark.parametrize("use_no_sync", [False, True])
@pytest.mark.parametrize("scenario", ["cond", "moe"])
def test_accumulation_with_partly_used_parameters(scenario, use_no_sync):
    results = run_ranks(sharded, 2, scenario, "full_shard", "adamw", None, 2, use_no_sync, timeout=120)
    check(results, reference(scenario, 2, "adamw", micro=2))


STRATEGIES = [("full_shard", None), ("shard_grad_op", None), ("no_shard", None), ("hybrid_shard", "auto")]


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy,mesh", STRATEGIES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("scenario", ["cond", "moe"])
def test_unused_parameters_matrix(scenario, world, strategy, mesh, optim):
    if mesh == "auto":
        mesh = (2, 2) if world == 4 else (1, world)
    results = run_ranks(sharded, world, scenario, strategy, optim, mesh, timeout=180)
    check(results, reference(scenario, world, optim))


@pytest.mark.slow
@pytest.mark.parametrize("use_no_sync", [False, True])
@pytest.mark.parametrize("strategy,mesh", STRATEGIES)
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("scenario", ["cond", "moe"])
def test_accumulation_matrix(scenario, world, strategy, mesh, use_no_sync):
    if mesh == "auto":
        mesh = (2, 2) if world == 4 else (1, world)
    results = run_ranks(sharded, world, scenario, strategy, "sgd", mesh, 3, use_no_sync, timeout=180)
    check(results, reference(scenario, world, "sgd", micro=3))
