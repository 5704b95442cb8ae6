"""Materialization at shard time: recorded deferred init (bit-equal to eager), meta-device init,
and real models whose rank 0 values win."""
import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from models import GPT, Block


def _deferred_worker(rank, world):
    torch.manual_seed(0)
    with fp.deferred_init():
        model = GPT()
    assert all(p.is_meta for p in model.parameters())
    fp.shard(model, auto_wrap_policy={Block})
    assert model.head.weight is model.tok.weight, "ties survive materialization"
    return fp.full_state_dict(model)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_deferred_init_is_bit_equal_to_eager(world):
    torch.manual_seed(0)
    want = GPT().state_dict()
    got = run_ranks(_deferred_worker, world)[0]
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


class RawInit(nn.Module):
    """Parameters made directly in __init__, HF-style _init_weights, a buffer."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(10, 7).normal_(0, 0.5))
        self.layers = nn.Sequential(*[nn.Linear(7, 7) for _ in range(3)])
        self.register_buffer("mask", torch.ones(7, 7).tril())
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)


def _raw_worker(rank, world):
    torch.manual_seed(3)
    with fp.deferred_init():
        model = RawInit()
    fp.shard(model, auto_wrap_policy={nn.Linear})
    return fp.full_state_dict(model)


def test_deferred_raw_parameters_and_hf_init():
    torch.manual_seed(3)
    want = RawInit().state_dict()
    got = run_ranks(_raw_worker, 2)[0]
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024


def _peak_worker(rank, world, d, layers):
    torch.manual_seed(0)
    with fp.deferred_init():
        model = GPT(vocab=64, d=d, n_layer=layers, seq=8)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                      # reset the peak-RSS counter
    base = _vm("VmRSS")
    fp.shard(model, auto_wrap_policy={Block})
    peak = _vm("VmHWM") - base
    shards = sum(h.flat_shard.numel() * 4 for u in model._fp_root.units for h in u.handles)
    unit = max(h.padded * 4 for u in model._fp_root.units for h in u.handles)
    return peak, shards, unit


def test_deferred_init_peak_memory_is_shards_plus_units():
    d, layers, world = 768, 6, 4
    full = (12 * d * d + 13 * d) * layers * 4
    peak, shards, unit = run_ranks(_peak_worker, world, d, layers, timeout=240)[0]
    assert peak <= shards + 2 * unit + 32 * 2**20, (peak / 2**20, shards / 2**20, unit / 2**20)
    assert peak < 0.75 * full, "materialization must never hold the whole model"


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)])
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.layers(x))


def _meta_worker(rank, world, counted):
    calls = {}
    original = nn.Linear.reset_parameters

    def counting(self):
        calls[id(self)] = calls.get(id(self), 0) + 1
        original(self)

    with torch.device("meta"):
        model = Plain()
    nn.Linear.reset_parameters = counting
    try:
        fp.shard(model, auto_wrap_policy={nn.Linear})
    finally:
        nn.Linear.reset_parameters = original
    assert sorted(calls.values()) == [1, 1, 1, 1], calls
    with fp.full_params(model):
        assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in model.layers.parameters())
    return True


def test_meta_init_calls_reset_parameters_once_per_module():
    assert run_ranks(_meta_worker, 2, True) == [True, True]


def _meta_no_reset(rank, world):
    with torch.device("meta"):
        model = GPT()
    fp.shard(model, auto_wrap_policy={Block})


def test_meta_module_without_reset_parameters_is_named():
    with pytest.raises(AssertionError, match="GPT.*reset_parameters.*deferred_init"):
        run_ranks(_meta_no_reset, 1)


def _rank0_wins(rank, world):
    torch.manual_seed(0)
    if rank == 0:
        model = Plain()
    else:
        with torch.device("meta"):
            model = Plain()
    fp.shard(model, auto_wrap_policy={nn.Linear})
    return fp.full_state_dict(model, rank0_only=False)


def _different_seeds(rank, world):
    torch.manual_seed(rank)
    model = fp.shard(Plain(), auto_wrap_policy={nn.Linear})
    return fp.full_state_dict(model, rank0_only=False)


@pytest.mark.parametrize("worker", [_rank0_wins, _different_seeds])
def test_rank0_values_win(worker):
    torch.manual_seed(0)
    want = Plain().state_dict()
    for got in run_ranks(worker, 3):
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_changes_after_deferred_init_are_refused():
    with fp.deferred_init():
        model = Plain()
    model.layers[0].to(torch.bfloat16)   # its tensors are now plain meta tensors with no recorded history
    with pytest.raises(fp.ShardingError, match=r"changed after the deferred_init block \(e.g. model.to\(dtype\)\)"):
        fp.shard(model, auto_wrap_policy={nn.Linear})
