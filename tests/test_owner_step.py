"""The generic owner step: torch's Adafactor and classes marked with fp.optim.register_per_tensor run their
stock ``step`` on full tensors (split parameters on their owner, whole ones where they lie), so on a sharded
model they equal the stock optimizer on the full model given the same reduced gradients, bit for bit; their
state (whole on one rank per parameter) checkpoints and loads at other world sizes.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from test_muon import Net

STEPS = 3


class NormSGD(torch.optim.Optimizer):
    """A per-tensor optimizer of ours: momentum, then a step of length lr along the buffer's direction
    (the norm is the whole tensor's: on shard pieces it would be each piece's)."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                buf = st.setdefault("buf", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                st["steps"] = st.get("steps", 0) + 1
                p.add_(buf / buf.norm().clamp_min(1e-12), alpha=-g["lr"])


fp.optim.register_per_tensor(NormSGD)


def _make(which, params):
    params = list(params)
    if which == "muon":      # stock torch.optim.Muon: the 2-D matrices (same on every rank: pieces keep ndim)
        return torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.05)
    return torch.optim.Adafactor(params, lr=0.05) if which == "adafactor" else NormSGD(params)


HELD = {"adafactor": 8, "registered": 8, "muon": 4}     # parameters with state


def _full_grads(model) -> dict:
    out = {}
    for name, p in model.named_parameters():
        info = fp.param_info(p)
        flat, count = torch.zeros(info.shape.numel()), torch.zeros(info.shape.numel())
        flat[info.start:info.end], count[info.start:info.end] = p.grad.reshape(-1), 1
        dist.all_reduce(flat)
        dist.all_reduce(count)
        out[name] = (flat / count).view(info.shape)
    return out


def _my_state(model, opt) -> dict:
    """The state this rank holds, by name: whole tensors of the parameters it steps."""
    return {n: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
            for n, p in model.named_parameters() if p in opt.state}


def _model(policy, seed=0, mesh=None):
    torch.manual_seed(seed)
    model = Net()
    kwargs = {"sharding_strategy": "hybrid_shard", "device_mesh": mesh} if mesh else {}
    fp.shard(model, auto_wrap_policy=policy, **kwargs)
    return model


def _worker(rank, world, which, policy, mesh=None):
    model = _model(policy, mesh=mesh)
    full = fp.full_state_dict(model, rank0_only=False)
    ref_params = {n: nn.Parameter(t.clone()) for n, t in full.items()}
    ref = _make(which, list(ref_params.values()))
    opt = _make(which, model.parameters())
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + rank)
        model(torch.randn(6, 8)).pow(2).mean().backward()
        for n, g in _full_grads(model).items():
            ref_params[n].grad = g
        ref.step()
        opt.step()
        opt.zero_grad()
        got = fp.full_state_dict(model, rank0_only=False)
        for n, q in ref_params.items():
            assert torch.equal(got[n], q.detach()), (step, n, (got[n] - q).abs().max())
    mine = _my_state(model, opt)
    for n, st in mine.items():
        want = ref.state[ref_params[n]]
        assert st.keys() == want.keys() and all(torch.equal(torch.as_tensor(st[k]), torch.as_tensor(want[k]))
                                                for k in st), n
    split = sorted(n for n, p in model.named_parameters() if fp.param_info(p).split)
    return split, sorted(mine), dict(fp.comm_stats.calls)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("policy", [None, {nn.Linear}], ids=["one-unit", "per-linear"])
@pytest.mark.parametrize("which", ["adafactor", "registered", "muon"])
def test_owner_step_is_the_stock_step_on_full_tensors(which, policy, world):
    results = run_ranks(_worker, world, which, policy, timeout=180)
    split = results[0][0]
    if policy is None:
        assert split, "a parameter is cut between ranks: the exchange path is exercised"
        assert all(calls.get("optim_exchange", 0) > 0 for _, _, calls in results)
    held = [n for _, mine, _ in results for n in mine]
    assert sorted(held) == sorted(set(held)) and len(held) == HELD[which], "each parameter's state on one rank"


def test_owner_step_hybrid_shard_each_replica_steps_its_own():
    results = run_ranks(_worker, 4, "adafactor", None, (2, 2), timeout=180)
    assert results[0][0] and all(calls.get("optim_exchange", 0) > 0 for _, _, calls in results)
    assert sorted(results[0][1] + results[1][1]) == sorted(results[2][1] + results[3][1])


def _train(model, opt, steps, first, rank, world):
    for s in range(first, first + steps):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(s)).chunk(world)[rank]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _save(rank, world, path, which):
    model = _model(None)
    opt = _make(which, model.parameters())
    _train(model, opt, 2, 0, rank, world)
    fp.save_checkpoint(path, model, opt)
    state = _my_state(model, opt)
    _train(model, opt, 1, 2, rank, world)
    return state, fp.full_state_dict(model, rank0_only=False)


def _load(rank, world, path, which):
    model = _model(None, seed=1)
    opt = _make(which, model.parameters())
    fp.load_checkpoint(path, model, opt)
    state = _my_state(model, opt)
    _train(model, opt, 1, 2, rank, world)
    return state, fp.full_state_dict(model, rank0_only=False)


def _merged(results) -> dict:
    out = {}
    for state, _ in results:
        for n, st in state.items():
            assert n not in out, f"state of {n} on two ranks"
            out[n] = st
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(torch.as_tensor(a[n][k]), torch.as_tensor(b[n][k]))
                                           for k in a[n]) for n in a)


@pytest.mark.parametrize("which", ["adafactor", "registered", "muon"])
def test_owner_step_state_resumes_n_to_m(tmp_path, which):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save, 2, path, which)
    want = _merged(saved)
    assert len(want) == HELD[which]
    for world in (2, 3, 1):
        loaded = run_ranks(_load, world, path, which)
        assert _same(_merged(loaded), want), world
        if world == 2:
            assert all(torch.equal(loaded[0][1][k], v) for k, v in saved[0][1].items()), "bit-identical resume"
