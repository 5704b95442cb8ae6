"""fp.optim.Muon is bit-identical to torch.optim.Muon on the full tensors, fed the same reduced gradients.

Every step each rank assembles the full reduced gradients from the ranks' pieces (no arithmetic beyond
an exact sum of identical replicas), steps a plain copy of the model with stock torch.optim.Muon (3-D expert
stacks: one stock Muon parameter per expert matrix), and compares parameters and momentum with
``torch.equal``.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks

STEPS = 3


class Net(nn.Module):
    """Uneven matrices, a 3-D expert stack, biases: some whole, some split, some empty on a rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 5)
        self.b = nn.Linear(5, 12, bias=False)
        self.experts = nn.Parameter(torch.randn(2, 12, 4) * 0.3)
        self.c = nn.Linear(4, 7)
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        h = torch.einsum("bi,eio->beo", h, self.experts).mean(1)
        return self.head(torch.tanh(self.c(h)))


MATRICES = ("a.weight", "b.weight", "experts", "c.weight")


def groups(named: dict) -> list:
    return [{"params": [named["a.weight"], named["b.weight"]]},
            {"params": [named["experts"], named["c.weight"]], "nesterov": False, "adjust_lr_fn": "match_rms_adamw",
             "weight_decay": 0.05}]


def full_grads(model) -> dict:
    """Full reduced gradient of every matrix, from the ranks' pieces (replicas hold identical pieces)."""
    out = {}
    for name, p in model.named_parameters():
        if name not in MATRICES:
            continue
        info = fp.param_info(p)
        flat = torch.zeros(info.shape.numel())
        count = torch.zeros(info.shape.numel())
        flat[info.start:info.end] = p.grad.reshape(-1)
        count[info.start:info.end] = 1
        dist.all_reduce(flat)
        dist.all_reduce(count)
        out[name] = (flat / count).view(info.shape)
    return out


class Reference:
    """Stock torch.optim.Muon on full tensors (one 2-D parameter per expert matrix)."""

    def __init__(self, full: dict):
        self.mats = {n: [nn.Parameter(full[n][e].clone()) for e in range(full[n].shape[0])] if n == "experts"
                     else nn.Parameter(full[n].clone()) for n in MATRICES}
        flat = {n: v for n, v in self.mats.items()}
        g = groups({**flat, "experts": None})
        g[1]["params"] = list(self.mats["experts"]) + [self.mats["c.weight"]]
        self.opt = torch.optim.Muon(g, lr=0.02)

    def step(self, grads: dict) -> None:
        for n, v in self.mats.items():
            for e, q in enumerate(v if n == "experts" else [v]):
                q.grad = grads[n][e] if n == "experts" else grads[n]
        self.opt.step()

    def value(self, n):
        v = self.mats[n]
        return torch.stack([q.detach() for q in v]) if n == "experts" else v.detach()

    def momentum(self, n):
        v = self.mats[n]
        st = self.opt.state
        return torch.stack([st[q]["momentum_buffer"] for q in v]) if n == "experts" else st[v]["momentum_buffer"]


def _worker(rank, world, strategy, mesh, policy):
    torch.manual_seed(0)
    model = Net()
    kwargs = {"device_mesh": mesh} if mesh else {}
    fp.shard(model, auto_wrap_policy=policy, sharding_strategy=strategy, **kwargs)
    named = dict(model.named_parameters())
    opt = fp.optim.Muon(groups(named), lr=0.02)
    ref = Reference(fp.full_state_dict(model, rank0_only=False))
    split = []
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + rank)
        x = torch.randn(6, 8)
        model(x).pow(2).mean().backward()
        ref.step(full_grads(model))
        opt.step()
        opt.zero_grad()
        full = fp.full_state_dict(model, rank0_only=False)
        for n in MATRICES:
            info = fp.param_info(named[n])
            assert torch.equal(full[n], ref.value(n)), (step, n, (full[n] - ref.value(n)).abs().max())
            mine = ref.momentum(n).reshape(-1)[info.start:info.end]
            assert torch.equal(opt.state[named[n]]["momentum_buffer"].reshape(-1), mine), (step, n)
            assert named[n].dim() == len(info.shape) and named[n].shape[1:] == info.shape[1:]
    for n in MATRICES:
        if fp.param_info(named[n]).split:
            split.append(n)
    return split, dict(fp.comm_stats.calls)


CASES = [(1, "full_shard", None), (2, "full_shard", None), (2, "shard_grad_op", None), (2, "no_shard", None),
         (3, "full_shard", None), (4, "full_shard", None), (4, "hybrid_shard", (2, 2))]


@pytest.mark.parametrize("world,strategy,mesh", CASES)
@pytest.mark.parametrize("policy", [None, {nn.Linear}], ids=["one-unit", "per-linear"])
def test_bit_identical_to_stock_muon(world, strategy, mesh, policy):
    results = run_ranks(_worker, world, strategy, mesh, policy, timeout=180)
    split = results[0][0]
    if world >= 2 and strategy in ("full_shard", "shard_grad_op") and policy is None:
        assert set(split) - {"experts"}, split     # a 2-D matrix is cut: the exchange path is exercised
    if set(split) - {"experts"}:
        assert all(calls.get("optim_exchange", 0) > 0 for _, calls in results)
    if strategy == "no_shard" or world == 1:
        assert split == [] and all(calls.get("optim_exchange", 0) == 0 for _, calls in results)


def _sharded(world_policy=None):
    torch.manual_seed(0)
    model = Net()
    fp.shard(model, auto_wrap_policy=world_policy)
    return model


def _step(model, opt):
    model(torch.randn(6, 8)).pow(2).mean().backward()
    opt.step()


def _stock_on_split(rank, world, stock):
    """The common recipe with stock torch.optim.Muon (no line changed) vs fp.optim.Muon, on split matrices."""
    model = _sharded()
    named = dict(model.named_parameters())
    routed = sorted(n for n, p in named.items() if p.ndim == 2)       # pieces keep their ndim
    assert any(fp.param_info(named[n]).split for n in routed)
    opt = (torch.optim.Muon if stock else fp.optim.Muon)([named[n] for n in routed], lr=0.02)
    fp.comm_stats.reset()
    for s in range(2):
        torch.manual_seed(s + rank)
        _step(model, opt)
        opt.zero_grad()
    return fp.full_state_dict(model, rank0_only=False), routed, fp.comm_stats.bytes.get("optim_exchange", 0)


def test_stock_muon_on_split_matrices_trains_exactly_like_fp_muon():
    """Stock Muon gets the owner step (fp32 rows and gradients to the owner, the stock step on the full
    matrix, fp32 rows back); fp.optim.Muon sends only bf16 updates there and back."""
    stock = run_ranks(_stock_on_split, 2, True)
    ours = run_ranks(_stock_on_split, 2, False)
    assert stock[0][1] == stock[1][1] == ["a.weight", "b.weight", "c.weight", "head.weight"]
    assert all(torch.equal(stock[0][0][k], ours[0][0][k]) for k in ours[0][0])
    mine, theirs = max(r[2] for r in ours), max(r[2] for r in stock)
    assert 0 < 2 * mine < theirs <= 4 * mine     # 8 bytes there or 4 back per element vs 2 and 2


def _stock_vs_ours_unsplit(rank, world, stock):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
    fp.shard(model)                 # one unit of 2 x 64 elements on 2 ranks: each matrix whole on one rank
    assert not any(fp.param_info(p).split for p in model.parameters())
    assert sorted(p.shape[0] for p in model.parameters()) == [0, 8]   # whole here, empty (0, 8) there
    cls = torch.optim.Muon if stock else fp.optim.Muon
    opt = cls(model.parameters(), lr=0.05)
    for s in range(2):
        torch.manual_seed(s + rank)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return fp.full_state_dict(model, rank0_only=False)


def test_stock_muon_on_unsplit_matrices_trains_like_fp_muon():
    stock = run_ranks(_stock_vs_ours_unsplit, 2, True)[0]
    ours = run_ranks(_stock_vs_ours_unsplit, 2, False)[0]
    assert all(torch.equal(stock[k], ours[k]) for k in ours)


def _per_tensor(rank, world, which):
    """Per-tensor optimizers the owner step does not cover (tests/test_owner_step.py covers Adafactor and
    registered classes) refuse pieces."""
    model = _sharded()
    if which == "lamb":
        class LAMB(torch.optim.SGD):      # by name: a third-party per-tensor optimizer
            pass
        opt = LAMB(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.LBFGS(model.parameters())
    try:
        _step(model, opt) if which != "lbfgs" else opt.step(lambda: model(torch.ones(1, 8)).sum())
    except fp.OptimizerError as e:
        return str(e)
    return None


@pytest.mark.parametrize("which", ["lamb", "lbfgs"])
def test_per_tensor_optimizers_refuse_pieces(which):
    msgs = run_ranks(_per_tensor, 2, which)
    assert all(m is not None and "fp.optim.Muon" in m and "register_per_tensor" in m for m in msgs), msgs


def test_muon_refuses_vectors_naming_adamw():
    model = _sharded()
    with pytest.raises(fp.OptimizerError, match="'a.bias'.*AdamW"):
        fp.optim.Muon(model.parameters())


def _built_before_shard(rank, world):
    """Built before fp.shard (Accelerate/Lightning order): fine, identities survive; never sharded: refused."""
    torch.manual_seed(0)
    model = Net()
    early = fp.optim.Muon([model.a.weight, model.b.weight], lr=0.02)
    plain = Net()
    late_plain = fp.optim.Muon([plain.a.weight])
    fp.shard(model)
    _step(model, early)
    plain(torch.randn(6, 8)).sum().backward()
    try:
        late_plain.step()
    except fp.OptimizerError as e:
        return str(e)


def test_muon_built_before_shard_works_and_never_sharded_names_the_fix():
    assert all("call fp.shard(model) before the first step" in m for m in run_ranks(_built_before_shard, 2))


def _accumulate(rank, world, micro):
    torch.manual_seed(0)
    model = Net()
    fp.shard(model)
    opt = fp.optim.Muon([p for n, p in model.named_parameters() if n in MATRICES], lr=0.02)
    torch.manual_seed(7 + rank)
    x = torch.randn(8, 8)
    fp.comm_stats.reset()
    if micro == 1:
        model(x).pow(2).sum().backward()
    else:
        parts = x.chunk(micro)
        with fp.no_sync(model):
            for xi in parts[:-1]:
                model(xi).pow(2).sum().backward()
        model(parts[-1]).pow(2).sum().backward()
    opt.step()
    return fp.full_state_dict(model, rank0_only=False), fp.comm_stats.calls.get("optim_exchange", 0)


def test_no_sync_accumulation_steps_once():
    one = run_ranks(_accumulate, 2, 1)
    four = run_ranks(_accumulate, 2, 4)
    for k in MATRICES:
        assert (one[0][0][k] - four[0][0][k]).abs().max() <= 1e-5, k   # sums in a different order
    assert one[0][1] == four[0][1] > 0, "one exchange per step, however many micro-batches"


def _full_state(model, opts) -> dict:
    """Every matrix's full momentum and AdamW moments, assembled from the ranks' pieces."""
    out = {}
    for i, opt in enumerate(opts):
        for g in opt.param_groups:
            for p in g["params"]:
                info = fp.param_info(p)
                for key, v in opt.state[p].items():
                    if key == "step":
                        out[i, info.fqn, key] = v.clone()
                        continue
                    flat, count = torch.zeros(info.shape.numel()), torch.zeros(info.shape.numel())
                    flat[info.start:info.end], count[info.start:info.end] = v.reshape(-1), 1
                    dist.all_reduce(flat)
                    dist.all_reduce(count)
                    out[i, info.fqn, key] = flat / count
    return out


def _two_optimizers(seed):
    torch.manual_seed(seed)
    model = Net()
    fp.shard(model)
    named = dict(model.named_parameters())
    muon = fp.optim.Muon(groups(named), lr=0.02)
    adamw = torch.optim.AdamW([p for n, p in named.items() if n not in MATRICES], lr=1e-2)
    return model, [muon, adamw]


def _train(model, opts, steps, first, rank, world):
    for s in range(first, first + steps):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(s)).chunk(world)[rank]
        model(x).pow(2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()


def _save(rank, world, path):
    model, opts = _two_optimizers(0)
    _train(model, opts, 2, 0, rank, world)
    fp.save_checkpoint(path, model, opts)
    state = (fp.full_state_dict(model, rank0_only=False), _full_state(model, opts))
    _train(model, opts, 1, 2, rank, world)
    return state, fp.full_state_dict(model, rank0_only=False)


def _load(rank, world, path):
    model, opts = _two_optimizers(1)
    fp.load_checkpoint(path, model, opts)
    state = (fp.full_state_dict(model, rank0_only=False), _full_state(model, opts))
    _train(model, opts, 1, 2, rank, world)
    return state, fp.full_state_dict(model, rank0_only=False)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_muon_and_adamw_state_resume_n_to_m(tmp_path):
    path = str(tmp_path / "ckpt")
    (saved, after), *_ = run_ranks(_save, 2, path)
    assert any(k[2] == "momentum_buffer" for k in saved[1]) and any(k[2] == "exp_avg" for k in saved[1])
    for world in (2, 3, 1):
        (loaded, resumed), *_ = run_ranks(_load, world, path)
        assert _equal(saved[0], loaded[0]) and _equal(saved[1], loaded[1]), world
        if world == 2:
            assert _equal(after, resumed), "resuming at the same world size is bit-identical"


def _exchange_bytes(rank, world, policy):
    torch.manual_seed(0)
    model = Net()
    fp.shard(model, auto_wrap_policy=policy)
    opt = fp.optim.Muon([p for p in model.parameters() if len(fp.param_info(p).shape) >= 2])
    model(torch.randn(6, 8)).pow(2).mean().backward()
    fp.comm_stats.reset()
    opt.step()
    return fp.comm_stats.bytes.get("optim_exchange", 0), fp.comm_stats.calls.get("optim_exchange", 0)


@pytest.mark.parametrize("policy", [None, {nn.Linear}], ids=["one-unit", "per-linear"])
def test_plan_predicts_the_exchange_bytes_counted(policy):
    from fsdp_plugin.planner._muon import muon_step
    from fsdp_plugin.planner._units import discover_units

    counted = run_ranks(_exchange_bytes, 3, policy)
    _, specs = discover_units(Net(), policy)
    sent, flops, calls = muon_step([h.shapes for h in specs if h.requires_grad], 3)
    assert [b for b, _ in counted] == sent and max(sent) > 0
    assert all(c == calls for _, c in counted) and max(flops) > 0
    plan = fp.plan(Net, world_size=3, auto_wrap_policy=policy, optimizer="muon", inputs=lambda: (torch.randn(6, 8),))
    w = plan.worlds[3]
    assert w.wire_bytes["optim_exchange"] == max(sent) and w.wire_calls["optim_exchange"] == calls
    assert w.optimizer_flops == max(flops)


def _combined(seed):
    """fp.optim.MuonWithAdamW with the same groups as _two_optimizers, interleaved (Muon, AdamW, Muon)."""
    torch.manual_seed(seed)
    model = Net()
    fp.shard(model)
    named = dict(model.named_parameters())
    muon = [dict(g, use_muon=True, lr=0.02) for g in groups(named)]
    rest = {"params": [p for n, p in named.items() if n not in MATRICES], "use_muon": False, "lr": 1e-2}
    return model, fp.optim.MuonWithAdamW([muon[0], rest, muon[1]])


def _scheduled(model, opts, steps, first, rank, world):
    """_train with a LambdaLR per optimizer (the Trainer's scheduler writes each group's lr)."""
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (s + 1)) for o in opts]
    for s in range(first, first + steps):
        _train(model, opts, 1, s, rank, world)
        for sc in scheds:
            sc.step()


def _by_name(state: dict) -> dict:
    return {(fqn, key): v for (_, fqn, key), v in state.items()}


def _combined_vs_pair(rank, world, path):
    model, opt = _combined(0)
    ref_model, ref_opts = _two_optimizers(0)
    _scheduled(model, [opt], 3, 0, rank, world)
    _scheduled(ref_model, ref_opts, 3, 0, rank, world)
    fp.save_checkpoint(path, model, opt)
    return (fp.full_state_dict(model, rank0_only=False), fp.full_state_dict(ref_model, rank0_only=False),
            _by_name(_full_state(model, [opt])), _by_name(_full_state(ref_model, ref_opts)),
            [g["lr"] for g in opt.param_groups])


def _combined_load(rank, world, path):
    model, opt = _combined(1)
    fp.load_checkpoint(path, model, opt)
    assert opt.muon.state is opt.state and opt.adamw.param_groups[0] is opt.param_groups[1]
    return fp.full_state_dict(model, rank0_only=False), _by_name(_full_state(model, [opt])), \
        [g["lr"] for g in opt.param_groups]


def test_muon_with_adamw_is_muon_then_adamw_and_resumes_n_to_m(tmp_path):
    """One optimizer (what the transformers Trainer takes) == fp.optim.Muon + torch.optim.AdamW, bit for bit,
    through a scheduler; its checkpoint loads at 2, 3 and 1 ranks."""
    path = str(tmp_path / "ckpt")
    (ours, ref, state, ref_state, lrs), *_ = run_ranks(_combined_vs_pair, 2, path)
    assert _equal(ours, ref) and _equal(state, ref_state)
    assert any(k[1] == "momentum_buffer" for k in state) and any(k[1] == "exp_avg" for k in state)
    assert lrs == [0.02 / 4, 1e-2 / 4, 0.02 / 4]
    for world in (2, 3, 1):
        (model, loaded, loaded_lrs), *_ = run_ranks(_combined_load, world, path)
        assert _equal(model, ours) and _equal(loaded, state) and loaded_lrs == lrs, world


def test_muon_with_adamw_needs_use_muon_in_every_group():
    model = Net()
    with pytest.raises(fp.OptimizerError, match="'use_muon'"):
        fp.optim.MuonWithAdamW([{"params": [model.a.weight]}])
    with pytest.raises(fp.OptimizerError, match="'a.bias'.*AdamW|route it to AdamW"):
        fp.optim.MuonWithAdamW([{"params": [model.a.bias], "use_muon": True}])
