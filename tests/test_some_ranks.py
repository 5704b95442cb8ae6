"""Units that run on some ranks only (``ShardingConfig.some_ranks_modules``, issue 22): a tower that runs on
rank 0 only at some steps, on no rank at others, on both, twice on one rank, trains exactly as one process on
the global batch (per-step loss, ``.grad is None`` and full parameters within 1e-5), with SGD + momentum and
AdamW, under gradient accumulation too; undeclared, the same model is still a CollectiveError."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import check_steps, global_mean, make_optimizer

D, B, WORLD = 8, 4, 2
# Per step: how many times each rank runs the tower (0: no image on that rank).
CALLS = [(1, 0), (0, 0), (1, 1), (0, 2), (1, 0), (0, 0)]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Tower(nn.Module):
    """A vision tower: blocks the wrap policy would pick (they merge into the tower's unit) and a projector."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Linear(2 * D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.proj = nn.Linear(D, D, bias=False)

    def forward(self, img):
        h = self.patch(img)
        for b in self.blocks:
            h = b(h)
        return self.proj(h)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.tower = Tower()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x, imgs, y):
        h = self.embed(x)
        for img in imgs:          # 0, 1 or more images per sample: rank-dependent
            h = h + self.tower(img)
        for b in self.layers:
            h = b(h)
        return ((self.head(h) - y) ** 2).mean()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(B, D, generator=g), torch.randn(B, 1, generator=g)
    imgs = [torch.randn(B, 2 * D, generator=g) for _ in range(CALLS[step][rank])]
    return x, imgs, y


def _record(model, loss, full):
    return loss, {n: p.grad is None for n, p in model.named_parameters()}, full


def reference(optim: str, accum: int):
    """One process: the loss is the mean over every rank's (micro-)batch, one backward per step."""
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer(optim, model.parameters())
    out = []
    for s in range(len(CALLS)):
        opt.zero_grad()
        loss = sum(model(*batch(s, r)) for r in range(WORLD) for _ in range(accum)) / (WORLD * accum)
        loss.backward()
        none = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        out.append((loss.item(), none, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    return out


def _worker(rank, world, optim, strategy, accum, declared=True, recompute=False):
    torch.manual_seed(0)
    model = Net()
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, activation_checkpointing=recompute,
             some_ranks_modules={Tower} if declared else None, timeout_s=60)
    tower = model._fp_root.some_ranks_units
    assert [u.fqn for u in tower] == (["tower"] if declared else [])
    opt = make_optimizer(optim, model.parameters())
    out = []
    for s in range(len(CALLS)):
        opt.zero_grad()
        total = 0.0
        for i in range(accum):       # gradient accumulation: every micro-batch but the last under no_sync
            ctx = fp.no_sync(model) if i < accum - 1 else _nothing()
            with ctx:
                loss = model(*batch(s, rank)) / accum
                loss.backward()
            total += loss.item()
        _, none, _ = _record(model, 0.0, None)
        opt.step()
        full = fp.full_state_dict(model)
        out.append((global_mean(torch.tensor(total), world), none, full if rank == 0 else {}))
    with torch.no_grad():          # an evaluation forward, image on rank 0 only: no backward frees the tower
        model(*batch(0, rank))
    assert all(not h.is_unsharded or h._aliases_shard for u in tower for h in u.handles)   # ZeRO-3 at rest
    return out


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_tower_on_some_ranks_trains_like_one_process(optim):
    got = run_ranks(_worker, WORLD, optim, "full_shard", 1, timeout=120)
    check_steps(got, reference(optim, 1))


@pytest.mark.parametrize("strategy", ["shard_grad_op", "no_shard"])
def test_other_strategies_and_gradient_accumulation(strategy):
    got = run_ranks(_worker, WORLD, "adamw", strategy, 2, timeout=120)
    check_steps(got, reference("adamw", 2))


def test_recomputed_tower():
    """Activation checkpointing of every unit, the tower included: recomputation needs no new gather."""
    got = run_ranks(_worker, WORLD, "sgd", "full_shard", 1, True, True, timeout=120)
    check_steps(got, reference("sgd", 1))


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoEBlock(Block):
    """A block (a unit) with a rarely routed expert wrapped alone: it runs only for batches routed to it."""

    def __init__(self):
        super().__init__()
        self.expert = Expert()

    def forward(self, x):
        h = super().forward(x)
        return h + self.expert(h) if h.mean() > 0 else h     # the routing decision depends on this rank's data


class MoENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(D, 1)

    def forward(self, x, y):
        for b in self.layers:
            x = b(x)
        return ((self.head(x) - y) ** 2).mean()


def moe_batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(B, D, generator=g) + (0.3 if (step + rank) % 3 == 0 else -0.3), torch.randn(B, 1, generator=g)


def _moe(rank, world):
    torch.manual_seed(0)
    model = fp.shard(MoENet(), auto_wrap_policy={MoEBlock, Expert}, some_ranks_modules={Expert}, timeout_s=60)
    assert [u.fqn for u in model._fp_root.some_ranks_units] == ["layers.0.expert", "layers.1.expert"]
    opt = make_optimizer("adamw", model.parameters())
    out = []
    for s in range(6):
        opt.zero_grad()
        loss = model(*moe_batch(s, rank))
        loss.backward()
        none = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        full = fp.full_state_dict(model)     # collective: every rank calls it
        out.append((global_mean(loss, world), none, full if rank == 0 else {}))
    return out


def test_rarely_routed_expert_wrapped_alone():
    torch.manual_seed(0)
    model = MoENet()
    opt = make_optimizer("adamw", model.parameters())
    want, ran = [], []
    model.layers[0].expert.register_forward_hook(lambda *a: ran.append(current))
    for s in range(6):
        opt.zero_grad()
        losses = []
        for r in range(WORLD):
            current = (s, r)
            losses.append(model(*moe_batch(s, r)))
        loss = sum(losses) / WORLD
        loss.backward()
        none = {n: p.grad is None for n, p in model.named_parameters()}
        opt.step()
        want.append((loss.item(), none, {k: v.detach().clone() for k, v in model.state_dict().items()}))
    assert any(w[1]["layers.0.expert.up.weight"] for w in want), "some step must route to no expert anywhere"
    assert any(len({r for st, r in ran if st == s}) == 1 for s in range(6)), f"no step routes on one rank: {ran}"
    check_steps(run_ranks(_moe, WORLD, timeout=120), want)


def _bf16(rank, world, declared):
    torch.manual_seed(0)
    model = fp.shard(Net(), auto_wrap_policy={Block}, some_ranks_modules={Tower} if declared else None,
                     mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16), timeout_s=60)
    opt = make_optimizer("adamw", model.parameters())
    for s in range(3):
        x, _, y = batch(s, rank)
        img = torch.randn(B, 2 * D, generator=torch.Generator().manual_seed(s + 10 * rank))
        opt.zero_grad()
        model(x, [img], y).backward()      # every rank runs the tower: declared or not, the same numbers
        opt.step()
    return fp.full_state_dict(model)


def test_bf16_compute_fp32_reduce_same_as_undeclared_when_every_rank_runs_it():
    """Under mixed precision the deferred reduction casts and averages as the in-backward one does."""
    declared, plain = (run_ranks(_bf16, WORLD, flag, timeout=120)[0] for flag in (True, False))
    for k in plain:
        assert torch.equal(declared[k], plain[k]), k


JOIN_STEPS = (4, 2)      # rank 1 runs out of batches after two steps and shadows the other two


def _joined(rank, world):
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = fp.shard(Net(), auto_wrap_policy={Block}, some_ranks_modules={Tower}, timeout_s=60)
    opt = make_optimizer("sgd", model.parameters())
    with Join([model]):
        for s in range(JOIN_STEPS[rank]):
            opt.zero_grad()
            model(*batch(s, rank)).backward()
            opt.step()
    return fp.full_state_dict(model)


def test_uneven_inputs_under_join():
    """A joined rank replays the root's forward: it gathers the tower and adds zeros like any rank without it."""
    got = run_ranks(_joined, WORLD, timeout=120)[0]
    torch.manual_seed(0)
    model = Net()
    opt = make_optimizer("sgd", model.parameters())
    for s in range(max(JOIN_STEPS)):
        opt.zero_grad()
        (sum(model(*batch(s, r)) for r in range(WORLD) if s < JOIN_STEPS[r]) / WORLD).backward()
        opt.step()
    for k, v in model.state_dict().items():
        assert (got[k] - v).abs().max().item() <= 1e-5, k


def _undeclared(rank, world):
    try:
        _worker(rank, world, "sgd", "full_shard", 1, declared=False)
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_undeclared_tower_is_still_a_collective_error():
    msgs = run_ranks(_undeclared, WORLD, timeout=120)
    assert all("ranks diverged" in m and "some_ranks_modules" in m for m in msgs), msgs


def test_config_names_and_validation():
    model = Net()
    from fsdp_plugin._build.wrap import select_unit_modules, some_ranks_fqns

    assert some_ranks_fqns(model, {"Tower"}) == ["tower"]
    assert some_ranks_fqns(model, lambda m: isinstance(m, (Tower, Block))) == ["tower", "layers.0", "layers.1"]
    units = [f for f, _ in select_unit_modules(model, {Block}, (), {"tower"})]
    assert units == ["", "tower", "layers.0", "layers.1"]    # the tower's own blocks merged into it
    with pytest.raises(fp.ConfigError, match="matches no submodule"):
        some_ranks_fqns(model, {"VisionTower"})
    with pytest.raises(fp.ConfigError, match="some_ranks_modules"):
        fp.ShardingConfig(some_ranks_modules=Tower)
    assert some_ranks_fqns(model, ()) == [] == some_ranks_fqns(model, None)   # opt-out; no modality config here


def test_plan_holds_the_tower_all_step():
    """fp.plan builds the same units and keeps the tower's full parameters from the root's pre-forward on."""
    inputs = lambda: (torch.randn(B, D), [torch.randn(B, 2 * D)], torch.randn(B, 1))
    plan = fp.plan(Net, world_size=2, auto_wrap_policy={Block}, some_ranks_modules={Tower}, inputs=inputs,
                   loss_fn=lambda loss: loss)
    assert [u["name"] for u in plan.units] == ["<root>", "tower", "layers.0", "layers.1"]
    assert set(plan.worlds[2].unsharded_units) == {"<root>", "tower", "layers.0", "layers.1"}


def test_lightning_strategy_passes_it_through():
    pytest.importorskip("lightning")
    from fsdp_plugin.integrations.lightning._plumbing import sharding_config

    assert sharding_config({"some_ranks_modules": {"CLIPVisionModel"}}).some_ranks_modules == {"CLIPVisionModel"}
