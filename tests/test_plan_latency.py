"""Issue 30: fp.plan's latency terms at cluster scale and the status thread's store budget, by arithmetic."""
from __future__ import annotations

import torch

import fsdp_plugin as fp
from fsdp_plugin._comm import status
from fsdp_plugin.planner._latency import latency_terms, ring_steps
from models import GPT, Block

V = 64


def test_store_budget_at_1024_ranks():
    # 0.5 s up to 128 ranks; at 1,024: 1024 ranks x 2 ops / 512 ops/s = 4 s, so 512 operations per second in all
    assert status.period(2) == status.period(128) == 0.5
    assert status.period(1024) == 4.0
    assert 1024 * status.OPS_PER_PERIOD / status.period(1024) == status.STORE_OPS_PER_S


def test_latency_terms_count_ring_steps():
    calls = {"all_gather": 6, "reduce_scatter": 4}
    t = latency_terms(calls, world=1024, shard=1024, replicate=1, link_latency_us=10)
    # 10 unit collectives x 1023 steps + the mask all-reduce (2 x 1023 steps), 10 us each
    assert t["ring_steps"] == {"all_gather": 6138, "reduce_scatter": 4092, "all_reduce": 0, "control": 2046,
                               "pairing": 0}
    assert abs(t["latency_floor_s"] - (10 + 2) * 1023 * 10e-6) < 1e-12
    assert t["host_blocking_waits"] == 1 and t["control_collectives"] == 1
    strict = latency_terms(calls, world=1024, shard=1024, replicate=1, pairing_check="strict", link_latency_us=10)
    assert strict["pairing_announcements"] == 12 and strict["host_blocking_waits"] == 13
    hybrid = latency_terms({"all_gather": 6, "reduce_scatter": 4, "all_reduce": 4}, 1024, 8, 128)
    assert hybrid["ring_steps"]["all_gather"] == 6 * 7 and hybrid["ring_steps"]["all_reduce"] == 4 * ring_steps(
        "all_reduce", 128)


def test_plan_reports_latency_terms_per_world():
    plan = fp.plan(lambda: GPT(vocab=V, d=32, n_layer=3, seq=16), world_size=[64, 1024], auto_wrap_policy={Block},
                   inputs=lambda: (torch.randint(0, V, (4, 16)),), device="cuda", link_latency_us=20)
    lat = {w: plan.worlds[w].latency for w in (64, 1024)}
    assert lat[64]["unit_collectives"] == lat[1024]["unit_collectives"] > 0     # the schedule: world-independent
    assert lat[1024]["latency_floor_s"] > lat[64]["latency_floor_s"] * 10      # ring steps grow with N
    assert lat[1024]["host_blocking_waits"] == 1 and lat[1024]["link_latency_us"] == 20
    assert "latency floor" in str(plan)


def test_cli_prints_the_latency_rows_when_asked(capsys, tmp_path):
    from fsdp_plugin.planner.cli import main
    factory = tmp_path / "tiny_model_t30.py"
    factory.write_text("from models import GPT\n\ndef build():\n    return GPT(vocab=64, d=32, n_layer=2, seq=16)\n")
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        assert main(["tiny_model_t30:build", "--world", "8", "1024", "--device", "cuda", "--seq", "16",
                     "--link-latency-us", "25"]) == 0
    finally:
        sys.path.remove(str(tmp_path))
    out = capsys.readouterr().out
    assert "latency floor" in out and "25 us per hop" in out and "blocking waits / step" in out, out
