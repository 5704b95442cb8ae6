"""fp.plan across nodes on CPU/gloo (RESULTS § 35d): the replay's counts behind the three costs the link model
adds there: every collective's per-call host cost (crossing or not), the socket writes the training thread does
itself (``link_sync_bytes``) and the collectives waited with no compute since their issue
(``exposed_inter_bytes``). Counts, not timings."""
import pytest

import fsdp_plugin as fp
from fsdp_plugin.planner import _replay, _world
from fsdp_plugin.planner._time import Calibration
from tests.models import GPT, Block, gpt_batch

KW = dict(auto_wrap_policy={Block}, inputs=lambda: gpt_batch(0, 0), device="cpu")


def _replayed(monkeypatch, **kw):
    seen = {}
    real = _world.replay

    def replay(*a, **k):
        seen["res"] = real(*a, **k)
        return seen["res"]
    monkeypatch.setattr(_world, "replay", replay)
    w = fp.plan(GPT, **KW, **kw)
    return w, seen["res"]


def test_every_call_pays_the_calibrated_latency_also_when_it_crosses_the_link(monkeypatch):
    """2 nodes × 1: every collective crosses; before § 35d their calibrated per-call cost was dropped."""
    cal = Calibration(1e15, 1e15, 1e15, latency_s=1e-3, overlap=0.0, op_overhead_s=0.0)
    plan, res = _replayed(monkeypatch, world_size=2, nodes=2, link_gbps=1e9, calibration=cal)
    w = plan.worlds[2]
    assert w.comm_s == pytest.approx(sum(res.calls.values()) * 1e-3, rel=1e-3)


def test_sync_bytes_are_each_message_to_another_node_up_to_the_socket_buffer(monkeypatch):
    plan, res = _replayed(monkeypatch, world_size=2, nodes=2, link_gbps=1)
    inter = sum(plan.worlds[2].inter_node_bytes.values())
    assert res.link_sync_bytes == inter > 0          # the test GPT's messages are far below 4 MiB
    monkeypatch.setattr(_replay, "SOCKET_SEND_BUFFER", 1000)
    _, capped = _replayed(monkeypatch, world_size=2, nodes=2, link_gbps=1)
    messages = sum(res.calls.values())                 # world 2: one message per collective
    assert capped.link_sync_bytes == 1000 * messages
    _, one_node = _replayed(monkeypatch, world_size=2, link_gbps=None)
    assert one_node.link_sync_bytes == 0 and one_node.exposed_inter_bytes == 0


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "hybrid_shard"])
def test_exposed_bytes_are_the_collectives_waited_with_no_compute_since_their_issue(monkeypatch, strategy):
    """2 nodes × 1 (every byte crosses; world 2: a unit's all-gather or reduce-scatter sends half its bytes, a
    replica all-reduce all of them). Exposed: every forward all-gather without ``forward_prefetch`` (waited at
    once; with it only the root's, nothing precedes it), the root's reduction (issued after backward's last
    kernel) and the last block's (the engine keeps none in flight once the root's gradient is next); the
    other blocks' reductions and backward gathers overlap the next unit's backward."""
    sizes = None
    exposed = {}
    for prefetch in (False, True):
        plan, res = _replayed(monkeypatch, world_size=2, nodes=2, link_gbps=1, sharding_strategy=strategy,
                              forward_prefetch=prefetch)
        sizes = [u["bytes"] for u in plan.units]          # fp32, padded to 2 (even sizes here)
        exposed[prefetch] = res.exposed_inter_bytes
    root, block = sizes[0], sizes[1]
    if strategy == "hybrid_shard":                         # no gathers (shard group of 1): the replicas' all-reduce
        assert exposed[False] == exposed[True] == root + block
        return
    assert exposed[True] == root // 2 + root // 2 + block // 2
    assert exposed[False] - exposed[True] == sum(sizes[1:]) // 2


def test_cpu_step_adds_sync_and_exposed_link_time(monkeypatch):
    cal = Calibration(1e12, 1e12, 1e9, latency_s=0.0, overlap=0.0, op_overhead_s=0.0)
    plan, res = _replayed(monkeypatch, world_size=2, nodes=2, link_gbps=0.008, calibration=cal)   # 1 MB/s
    w = plan.worlds[2]
    exposed = res.exposed_inter_bytes / 1e6
    rest = w.link_s - exposed
    assert w.step_s == pytest.approx(res.link_sync_bytes / 1e9 + w.compute_s + exposed + rest
                                     - 0.55 * min(w.compute_s, rest), rel=1e-6)
