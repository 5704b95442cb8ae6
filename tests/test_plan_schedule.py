"""fp.plan follows the engine's schedule and rules (no timing): the replay runs the engine's own RootState
decisions, the fake run frees checkpoint recomputation unit by unit, and the planner shares the engine's
helpers (mesh dims, size parser). Cheap and deterministic: no process group, fake tensors only."""
import pytest
import torch
from models import GPT, Block
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin._groups.mesh import mesh_dims
from fsdp_plugin._build.strategy import ShardScope
from fsdp_plugin._sizes import parse_size
from fsdp_plugin.errors import ConfigError
from fsdp_plugin.planner import PlanError, parse_bytes
from fsdp_plugin.planner import _fake_run as _fake_run
from fsdp_plugin.planner._fake_run import Event, Timeline
from fsdp_plugin.planner._replay import Layout, replay
from fsdp_plugin.planner._units import HandleSpec, UnitSpec, discover_units
from fsdp_plugin.planner._world import CPU_RUNTIME_BYTES, layout_for

N = 1000          # elements per unit (fp32, even: no padding at world 2)
SPIKE = 10**9     # activation bytes of one segment, so that the peak lands exactly there


def _units(n=3):
    units = [UnitSpec("" if i == 0 else f"u{i}", nn.Identity(), [i]) for i in range(n)]
    return units, [HandleSpec(i, torch.float32, True, N, [], N) for i in range(n)]


def _timeline(spike_before: tuple) -> Timeline:
    """Root 0 then units 1, 2 in forward; backward: root's head, 2, 1, then the root's own gradient. The
    segment ending at event ``spike_before`` (kind, index) peaks at SPIKE activation bytes."""
    seq = [("pre_forward", 0, False), ("pre_forward", 1, False), ("post_forward", 1, False),
           ("pre_forward", 2, False), ("post_forward", 2, False), ("post_forward", 0, False),
           ("pre_backward", 0, True), ("pre_backward", 2, True), ("grad_ready", 2, True),
           ("grads_dropped", 2, True), ("pre_backward", 1, True), ("grad_ready", 1, True),
           ("grads_dropped", 1, True), ("grad_ready", 0, True), ("grads_dropped", 0, True),
           ("end_backward", -1, True)]
    return Timeline(events=[Event(k, i, b, 0, SPIKE if (k, i) == spike_before else 0) for k, i, b in seq])


def _replay(spike_before, **cfg):
    units, handles = _units()
    lay = Layout(fp.ShardingConfig(sharding_strategy="full_shard", **cfg), world=2, shard_size=2, replicate_size=1)
    return replay(units, handles, _timeline(spike_before), lay, static=0, optimizer_step_extra=0).peak


def test_root_backward_prefetches_the_last_unit():
    """The engine's RootState decides: the root's backward starts by all-gathering the last unit (when an
    explicit policy resharded it after forward)."""
    peak = _replay(("pre_backward", 2), reshard_after_forward=True)
    assert peak.activations == SPIKE
    assert peak.unsharded_units == ("<root>", "u2") and peak.unsharded == 2 * N * 4
    off = _replay(("pre_backward", 2), reshard_after_forward=True, backward_prefetch=False)
    assert off.unsharded_units == ("<root>",)


def test_last_unit_kept_from_forward_to_backward_under_the_default_policy():
    """RootState.reshards_after_forward: the last unit in forward order is not resharded only to be gathered again."""
    kept = _replay(("pre_backward", 0))          # between the end of forward and the root's backward
    assert kept.unsharded_units == ("<root>", "u2")
    assert _replay(("pre_backward", 0), reshard_after_forward=True).unsharded_units == ("<root>",)
    assert _replay(("pre_backward", 2), backward_prefetch=False).unsharded_units == ("<root>", "u2")


def test_no_reduction_in_flight_when_the_roots_gradient_is_assembled():
    peak = _replay(("grad_ready", 0))
    assert peak.reducing == 0                       # unit 1's reduce-scatter was finished at once
    assert peak.grad_shards == 2 * (N // 2) * 4     # units 1 and 2 reduced into their shards
    between = _replay(("pre_backward", 1))          # one reduction (unit 2's) stays in flight elsewhere
    assert between.reducing == N * 4 + (N // 2) * 4


def _fake_timeline(ac: bool) -> Timeline:
    with torch.device("meta"):
        model = GPT(vocab=64, d=32, n_layer=3, seq=16)
    units, handles = discover_units(model, {Block})
    spec = _fake_run.RunSpec(torch.device("cpu"), None, None, False, {Block} if ac else None)
    return _fake_run.run(model, units, handles, spec, lambda: (torch.randint(0, 64, (8, 16)),), None)


def test_checkpoint_recomputation_is_freed_unit_by_unit():
    """Recomputed activations die with their unit's backward (FlopCounterMode kept them to the end)."""
    plain, ac = _fake_timeline(False), _fake_timeline(True)
    assert ac.act_end == plain.act_end
    level = [e.act_now for e in ac.events if e.kind == "pre_backward" and e.index > 0]
    assert level == sorted(level, reverse=True), level
    assert ac.flops > plain.flops > 0


def test_cpu_runtime_term():
    kw = dict(world_size=2, auto_wrap_policy={Block}, inputs=lambda: (torch.randint(0, 64, (2, 16)),))
    build = lambda: GPT(vocab=64, d=32, n_layer=2, seq=16)   # noqa: E731
    assert fp.plan(build, device="cpu", **kw).worlds[2].runtime == CPU_RUNTIME_BYTES["fp32"]
    assert fp.plan(build, device="cpu", mixed_precision="bf16", **kw).worlds[2].runtime == \
        CPU_RUNTIME_BYTES["low_precision"]
    assert fp.plan(build, calibration="a100-80gb", **kw).worlds[2].runtime == 0


def test_mesh_dims_are_the_engines():
    assert mesh_dims(ShardScope.WORLD, 8, 8) == (8, 1) and mesh_dims(ShardScope.NONE, 8, 8) == (1, 8)
    assert mesh_dims(ShardScope.NODE, 16, 8) == (8, 2) and mesh_dims(ShardScope.NODE, 8, 8, (4, 2)) == (2, 4)
    with pytest.raises(ConfigError, match="device_mesh"):
        mesh_dims(ShardScope.NODE, 12, 8)
    lay = layout_for(16, fp.ShardingConfig(sharding_strategy="hybrid_shard"), gpus_per_node=8)
    assert (lay.shard_size, lay.replicate_size) == (8, 2)


def test_one_size_parser():
    for text in ("80GB", "24GiB", "512MiB", "1e9", 2**20):
        assert parse_bytes(text) == parse_size(text)
    assert parse_bytes("1e9") == 10**9 and parse_bytes("2 GiB") == 2 * 2**30
    with pytest.raises(PlanError, match="80GB"):
        parse_bytes("lots")


def test_fake_run_prices_exactly_the_ops_a_real_run_dispatches():
    """The step-time inputs (FLOPs, attention FLOPs, other bytes, ops) of the fake run equal those of a real
    forward+backward priced op by op with the same rule (FakeTensor's own prim.device queries once counted as
    ~4x the model's real non-matmul bytes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Priced(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.total = {"flop": 0, "attention": 0, "bytes": 0, "ops": 0}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            kind, amount = _fake_run.op_cost(func, args, kwargs or {}, out)
            if kind != "meta":
                self.total["ops"] += 1
                self.total[kind] = self.total.get(kind, 0) + amount
            return out
    torch.manual_seed(0)
    model, idx = GPT(vocab=64, d=32, n_layer=3, seq=16), torch.randint(0, 64, (8, 16))
    with Priced() as real:
        model(idx).float().sum().backward()
    fake = _fake_timeline(False)
    assert real.total["attention"] == fake.attention_flops > 0
    assert (real.total["flop"] + real.total["attention"], real.total["bytes"], real.total["ops"]) == \
        (fake.flops, fake.other_bytes, fake.ops)
