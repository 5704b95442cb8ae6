"""Engine behaviour beyond plain parity: accumulation, clipping, awkward models, evaluation,
activation checkpointing, forward methods, and the communication volume of each strategy."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, make_optimizer, single_process, train
from models import GPT, Block, gpt_batch
from fsdp_plugin._schedule.states import ShardedState


# ---------------------------------------------------------------- model zoo
class Shared(nn.Linear):
    pass


class Frozen(nn.Linear):
    pass


class Inner(nn.Linear):
    pass


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.inner = Inner(16, 16)

    def forward(self, x):
        return self.inner(torch.tanh(self.lin(x)))


class Branch(nn.Linear):
    pass


class Head(nn.Module):
    def __init__(self, shared_weight):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.proj.weight = shared_weight     # tied to another unit's parameter

    def forward(self, x):
        return self.proj(x)


class Zoo(nn.Module):
    """Ties across units, a frozen unit, a unit called twice, a conditional unit, nested units,
    a parameter with a prime number of elements and a 0-d parameter."""

    use_branch = True   # set per step by zoo_step_batch, the same on every rank

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shared = Shared(16, 16)
        self.frozen = Frozen(16, 16)
        self.frozen.requires_grad_(False)
        self.outer = Outer()
        self.branch = Branch(16, 16)
        self.head = Head(self.shared.weight)
        self.prime = nn.Parameter(torch.randn(13) * 0.1)
        self.register_buffer("offset", torch.linspace(-1, 1, 16))

    def forward(self, x, y):
        h = self.inp(x) * self.scale + self.offset
        h = self.shared(torch.tanh(self.shared(torch.tanh(h))))
        h = self.outer(self.frozen(h))
        if self.use_branch:
            h = self.branch(torch.tanh(h))
        h = self.head(h) + F.pad(self.prime, (0, 3))
        return F.mse_loss(h, y)


ZOO_UNITS = (Shared, Frozen, Outer, Inner, Branch, Head)


def zoo_batch(step, rank, batch=4):
    g = torch.Generator().manual_seed(7 * step + 1000 * rank)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 16, generator=g)


def zoo_step_batch(step, rank):
    """The step's batch; every third step skips the conditional unit."""
    Zoo.use_branch = step % 3 != 1
    return zoo_batch(step, rank)


def _zoo_sharded(rank, world, strategy, steps):
    torch.manual_seed(0)
    model = fp.shard(Zoo(), auto_wrap_policy=set(ZOO_UNITS), sharding_strategy=strategy)
    opt = make_optimizer("sgd", model.parameters())
    losses = train(model, opt, rank, world, steps, zoo_step_batch,
                   each=lambda s, loss: _assert(model.frozen.weight.grad is None))
    return losses, fp.full_state_dict(model)


def _assert(condition):
    assert condition


@pytest.mark.parametrize("world,strategy", [(2, "full_shard"), (3, "full_shard"), (3, "shard_grad_op"),
                                            (2, "no_shard")])
def test_model_zoo_parity(world, strategy):
    want_losses, want_state = single_process(world, "sgd", steps=8, model_fn=Zoo, batch_fn=zoo_step_batch)
    got = run_ranks(_zoo_sharded, world, strategy, 8)
    assert_close_losses(got[0][0], want_losses)
    assert_close_state(got[0][1], want_state)


# ------------------------------------------------------ gradient accumulation
def _accumulate(rank, world, use_no_sync, micro=2, steps=4):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = gpt_batch(s * micro + m, rank)
            last = m == micro - 1
            if use_no_sync and not last:
                before = fp.comm_stats.bytes["reduce_scatter"]
                with fp.no_sync(model):
                    (model(x, y) / micro).backward()
                assert fp.comm_stats.bytes["reduce_scatter"] == before, "no_sync must not communicate"
            else:
                (model(x, y) / micro).backward()
        opt.step()
    return fp.full_state_dict(model)


def _accumulate_single(world, micro=2, steps=4):
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for s in range(steps):
        opt.zero_grad()
        for m in range(micro):
            xs, ys = zip(*[gpt_batch(s * micro + m, r) for r in range(world)])
            (model(torch.cat(xs), torch.cat(ys)) / micro).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("use_no_sync", [False, True])
def test_gradient_accumulation(use_no_sync):
    got = run_ranks(_accumulate, 2, use_no_sync)[0]
    assert_close_state(got, _accumulate_single(2))


# ------------------------------------------------------------------ clipping
def _clip(rank, world, norm_type, max_norm):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    x, y = gpt_batch(0, rank)
    model(x, y).backward()
    norm = fp.clip_grad_norm_(model, max_norm, norm_type=norm_type)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.step()
    return norm.item(), fp.full_state_dict(model)


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_grad_norm_matches_torch(norm_type):
    world, max_norm = 3, 0.05
    torch.manual_seed(0)
    model = GPT()
    xs, ys = zip(*[gpt_batch(0, r) for r in range(world)])
    model(torch.cat(xs), torch.cat(ys)).backward()
    want = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type).item()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    results = run_ranks(_clip, world, norm_type, max_norm)
    for norm, _ in results:
        assert abs(norm - want) <= 1e-5 * max(1.0, want), (norm, want)
    assert want > max_norm, "the test must actually clip"
    assert_close_state(results[0][1], model.state_dict())


# ---------------------------------------------------- evaluation, AC, methods
def _eval_then_train(rank, world):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    x, y = gpt_batch(0, rank)
    with torch.no_grad():
        logits = model(x)
    unsharded = [h.is_unsharded for u in model._fp_root.units for h in u.handles]
    assert not any(unsharded), "no_grad forward must leave every unit sharded"
    assert all(hasattr(p, "_fp_handle") for p in model.parameters())
    return logits


def test_no_grad_eval_matches_and_reshards():
    torch.manual_seed(0)
    model = GPT()
    want = [model(gpt_batch(0, r)[0]) for r in range(2)]
    got = run_ranks(_eval_then_train, 2)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-6)


def _ac_worker(rank, world, use_ac):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, activation_checkpointing={Block} if use_ac else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    fp.comm_stats.reset()
    counts = []
    losses = train(model, opt, rank, world, 3, each=lambda s, loss: counts.append(fp.comm_stats.calls["all_gather"]))
    return losses, [b - a for a, b in zip([0] + counts, counts)]


def test_activation_checkpointing_reuses_backward_unshard():
    plain = run_ranks(_ac_worker, 2, False)[0]
    ac = run_ranks(_ac_worker, 2, True)[0]
    assert_close_losses(ac[0], plain[0])
    assert_close_losses(ac[0], single_process(2, "sgd", steps=3)[0])
    # root once + 3 blocks x (forward + backward), except that once the order is frozen (after the first
    # forward) the last block stays unsharded into its backward: recomputation adds no all-gather.
    assert ac[1] == plain[1] == [1 + 3 * 2, 1 + 3 * 2 - 1, 1 + 3 * 2 - 1]


class StepModule(GPT):
    def training_step(self, batch):
        x, y = batch
        return self(x, y)


def _forward_method(rank, world):
    torch.manual_seed(0)
    model = fp.shard(StepModule(), auto_wrap_policy={Block})
    fp.register_forward_method(model, "training_step")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return train(lambda *batch: model.training_step(batch), opt, rank, world, 3)


def test_register_forward_method():
    got = run_ranks(_forward_method, 2)[0]
    assert_close_losses(got, single_process(2, "sgd", steps=3)[0])


# ------------------------------------------------------ communication volume
def _bytes_per_step(rank, world, strategy, mesh):
    torch.manual_seed(0)
    kwargs = {"device_mesh": mesh} if mesh else {}
    model = fp.shard(GPT(vocab=61, d=20), auto_wrap_policy={Block}, sharding_strategy=strategy, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model(*gpt_batch(0, rank, vocab=61)).backward()   # warm-up step records the order
    opt.step()
    fp.comm_stats.reset()
    model(*gpt_batch(1, rank, vocab=61)).backward()
    handles = [(u.fqn, h.padded, h.chunk) for u in model._fp_root.units for h in u.handles]
    m = model._fp_root.mesh
    last = model._fp_root.exec_order[-1].fqn
    return dict(fp.comm_stats.bytes), handles, (m.shard_size, m.replicate_size), last


def _ring(numel, n, factor=1):
    return factor * numel * 4 * (n - 1) // n


@pytest.mark.parametrize("world,strategy,mesh", [(2, "full_shard", None), (3, "full_shard", None),
                                                 (3, "shard_grad_op", None), (3, "no_shard", None),
                                                 (4, "hybrid_shard", (2, 2))])
def test_bytes_per_step_match_formula(world, strategy, mesh):
    got, handles, (s, r), last = run_ranks(_bytes_per_step, world, strategy, mesh)[0]
    assert last == "blocks.2"
    # the root and (default policy) the last unit in forward order are not resharded after forward
    gathers = lambda fqn: 1 if (fqn in ("", last) or strategy == "shard_grad_op") else 2
    want = {}
    if s > 1:
        want["all_gather"] = sum(gathers(f) * _ring(p, s) for f, p, _ in handles)
        want["reduce_scatter"] = sum(_ring(p, s) for _, p, _ in handles)
    if r > 1:
        want["all_reduce"] = sum(_ring(c, r, factor=2) for _, _, c in handles)
    assert {k: v for k, v in got.items() if k in want} == want
    assert set(got) <= set(want) | {"control"}
    if strategy == "full_shard":
        psi = sum(p for _, p, _ in handles) * 4
        kept = sum(p for f, p, _ in handles if f in ("", last)) * 4
        assert sum(got.values()) - got.get("control", 0) == pytest.approx((3 * psi - kept) * (world - 1) / world, abs=8)


# ------------------------------------------------------ frozen units (LoRA-like)
class Adapter(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.base.requires_grad_(False)
        self.lora = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora(x)


class Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(Adapter() for _ in range(n))

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return F.mse_loss(h, y)


def _frozen_freed_in_backward(rank, world):
    torch.manual_seed(0)
    model = fp.shard(Stack(), auto_wrap_policy={Adapter})
    alive = []
    units = model._fp_root.units[1:]
    for u in units:     # when a layer's inputs get their gradient, the layer above must already be free
        u.module.register_full_backward_pre_hook(
            lambda m, g: alive.append(sum(h.is_unsharded for v in units for h in v._frozen)))
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loss = model(*zoo_batch(0, rank))
    loss.backward()
    opt.step()
    return max(alive), fp.full_state_dict(model)


def test_frozen_handles_are_freed_during_backward():
    peak, _ = run_ranks(_frozen_freed_in_backward, 2)[0]
    assert peak <= 2, f"{peak} frozen layers unsharded at once; expected at most 2 of 4"


# ---------------------------------------------------------------- rate limiter
def _max_unsharded(rank, world, limit, forward_prefetch):
    torch.manual_seed(0)
    model = fp.shard(GPT(n_layer=6), auto_wrap_policy={Block}, limit_all_gathers=limit,
                     forward_prefetch=forward_prefetch)
    blocks = model._fp_root.units[1:]
    seen = []

    def count(*_):
        seen.append(sum(h.state is not ShardedState.SHARDED for u in blocks for h in u.handles))
    for u in blocks:
        u.module.register_forward_hook(count)
        u.module.register_full_backward_hook(count)
    for s in range(2):
        model(*gpt_batch(s, rank)).backward()
    return max(seen)


@pytest.mark.parametrize("forward_prefetch", [False, True])
def test_limit_all_gathers_bounds_unsharded_units(forward_prefetch):
    assert run_ranks(_max_unsharded, 2, True, forward_prefetch)[0] <= 2
    assert run_ranks(_max_unsharded, 2, False, forward_prefetch)[0] == 3, "the test must be able to fail"


# ----------------------------------------------------------------- CPU offload
def _offload(rank, world):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, cpu_offload=True)
    losses = train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), rank, world, 4)
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in model.parameters())
    return losses


def test_cpu_offload_is_a_correct_no_op_on_cpu():
    assert_close_losses(run_ranks(_offload, 2)[0], single_process(2, "sgd", steps=4)[0])
