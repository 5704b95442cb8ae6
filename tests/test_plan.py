"""fp.plan / fsdp-plugin plan, profiler labels and logging. Accuracy against measured peaks is a benchmark
(benchmarks/plan_accuracy.py), not a test; here: the public call, exact agreement with the engine where the
planner claims it (units, wire bytes), and orderings that must hold."""
import json
import logging

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from fsdp_plugin.cli import main as cli_main
from fsdp_plugin.planner import PlanError
from fsdp_plugin.planner.api import plan_strategies
from models import GPT, Block, gpt_batch

V = 64


def build():
    return GPT(vocab=V, d=32, n_layer=3, seq=16)


def _plan(world=(1, 2, 4), **kw):
    kw = {"sharding_strategy": "full_shard", "auto_wrap_policy": {Block}, "optimizer": "adamw",
          "inputs": lambda: (torch.randint(0, V, (4, 16)),), "loss_fn": None, **kw}
    return fp.plan(build, world_size=list(world), **kw)


def test_the_documented_call_and_its_orderings():
    plan = fp.plan(build, world_size=[1, 2, 4], sharding_strategy="full_shard", auto_wrap_policy={Block},
                   optimizer="adamw", inputs=lambda: (torch.randint(0, V, (4, 16)),), loss_fn=None)
    assert isinstance(plan, fp.Plan)
    peak = plan.peak_bytes
    assert peak[1] > peak[2] > peak[4] > 0
    w1, w4 = plan.worlds[1], plan.worlds[4]
    assert w1.optimizer_state == 2 * w1.param_shards and w4.param_shards < w1.param_shards / 3
    assert w1.activations > 0 and w1.wire_total == 0 and w4.wire_total > plan.worlds[2].wire_total
    assert [u["name"] for u in plan.units] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    assert json.loads(json.dumps(plan.to_dict()))["peak_bytes"]["2"] == peak[2]
    assert "PEAK per rank" in str(plan)


def test_plan_takes_the_one_config_object_and_keywords_as_its_shorthands():
    inputs = lambda: (torch.randint(0, V, (4, 16)),)  # noqa: E731
    cfg = fp.ShardingConfig(sharding_strategy="shard_grad_op", auto_wrap_policy={Block},
                            mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16))
    by_config = fp.plan(build, world_size=2, config=cfg, inputs=inputs)
    by_keywords = fp.plan(build, world_size=2, sharding_strategy="shard_grad_op", auto_wrap_policy={Block},
                          mixed_precision="bf16", inputs=inputs)
    assert by_config.strategy == by_keywords.strategy == "shard_grad_op"
    assert by_config.peak_bytes == by_keywords.peak_bytes and by_config.mixed_precision == "bfloat16"
    assert fp.plan(build, 2, cfg, sharding_strategy="full_shard", inputs=inputs).strategy == "full_shard"
    with pytest.raises(PlanError, match="unknown option.*ShardingConfig fields"):
        fp.plan(build, world_size=2, sharding="full_shard")
    with pytest.raises(PlanError, match="unknown sharding_strategy"):   # ShardingConfig's own validation
        fp.plan(build, world_size=2, sharding_strategy="zero3")


def test_the_planner_subpackage_and_the_function_do_not_clash():
    import fsdp_plugin.planner
    assert callable(fp.plan) and fp.planner.calibrate is fsdp_plugin.planner.calibrate
    assert fp.planner.plan is fp.plan


def test_strategies_optimizers_checkpointing_and_precision_order_memory():
    strategies = ("full_shard", "shard_grad_op", "no_shard")
    plans = plan_strategies(build, [4], list(strategies), auto_wrap_policy={Block},
                            inputs=lambda: (torch.randint(0, V, (4, 16)),))
    by = {s: p.worlds[4] for s, p in zip(strategies, plans)}
    assert by["full_shard"].peak <= by["shard_grad_op"].peak < by["no_shard"].peak
    assert by["full_shard"].unsharded_params < by["shard_grad_op"].unsharded_params   # ZeRO-3 frees after forward
    assert by["no_shard"].wire_bytes.keys() == {"all_reduce"}
    state = {o: _plan((1,), optimizer=o).worlds[1].optimizer_state for o in ("sgd", "sgd-momentum")}
    assert state["sgd"] == 0 and state["sgd-momentum"] > 0
    # a quarter of one rank's, plus the row-aligned layout's padding (test_rows.py: same as the engine's)
    assert 2 * state["sgd-momentum"] / 4 <= by["full_shard"].optimizer_state <= 1.03 * 2 * state["sgd-momentum"] / 4
    long_inputs = lambda: (torch.randint(0, V, (16, 16)),)   # noqa: E731
    base = _plan((2,), inputs=long_inputs)
    ac = _plan((2,), inputs=long_inputs, activation_checkpointing=True)
    bf16 = _plan((2,), inputs=long_inputs, mixed_precision="bf16")
    assert ac.worlds[2].activations < base.worlds[2].activations
    assert ac.flops_per_step > base.flops_per_step            # the recompute is counted
    assert bf16.worlds[2].activations < base.worlds[2].activations
    assert bf16.worlds[2].wire_bytes["all_gather"] * 2 == base.worlds[2].wire_bytes["all_gather"]


def test_nothing_is_allocated():
    """40 GB of parameters: planning it must not touch that memory."""
    plan = fp.plan(lambda: nn.Sequential(nn.Linear(100_000, 100_000), nn.Linear(100_000, 10)), world_size=[8],
                   auto_wrap_policy={nn.Linear}, optimizer="sgd", inputs=lambda: torch.zeros(2, 100_000))
    assert plan.worlds[8].param_shards > 40e9 / 8


def _measured(rank, world):
    from torch.profiler import profile

    torch.manual_seed(0)
    model = fp.shard(build(), auto_wrap_policy={Block})
    opt = torch.optim.AdamW(model.parameters())
    model(*gpt_batch(0, rank, batch=4, vocab=V)).backward()
    opt.step()
    fp.comm_stats.reset()
    with profile() as prof:
        for step in (1, 2):
            model(*gpt_batch(step, rank, batch=4, vocab=V)).backward()
            opt.step()
            opt.zero_grad()
    wire = {k: v // 2 for k, v in fp.comm_stats.bytes.items() if k != "control"}
    names = {e.name for e in prof.events() if e.name.startswith("fsdp_plugin::")}
    return wire, [u.name for u in model._fp_root.units], names, fp.memory_report(model)


def test_units_and_wire_bytes_equal_the_engine_and_every_unit_is_labelled_in_a_profile():
    wire, units, names, report = run_ranks(_measured, 2)[0]
    plan = fp.plan(build, world_size=2, auto_wrap_policy={Block}, inputs=lambda: gpt_batch(0, 0, batch=4, vocab=V))
    assert [u["name"] for u in plan.units] == units
    assert plan.worlds[2].wire_bytes == wire
    for unit in units:
        for what in ("unshard", "wait_unshard", "reshard", "reduce", "wait_reduce"):
            assert f"fsdp_plugin::{what}::{unit}" in names, (what, unit, sorted(names))
    assert "blocks.2" in report and "full_shard, world 2" in report


def test_logging_unit_table_at_info_and_phase_memory_at_debug(caplog):
    with caplog.at_level(logging.INFO, logger="fsdp_plugin"):
        model = fp.shard(build(), auto_wrap_policy={Block})
    assert "blocks.1" in caplog.text and "float32" in caplog.text and "backward end" not in caplog.text
    assert fp.memory_report(model).splitlines()[-1].startswith("total")
    with caplog.at_level(logging.DEBUG, logger="fsdp_plugin"):
        model = fp.shard(build(), auto_wrap_policy={Block})
        model(*gpt_batch(0, 0, vocab=V)).backward()
    phases = [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.DEBUG]
    assert phases == ["forward start", "forward end", "backward start", "backward end"]


def test_hf_config_file(tmp_path):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}))
    plan = fp.plan(str(tmp_path), world_size=[1, 2], batch_size=2, seq_len=16, device="cuda")   # NCCL semantics
    assert [u["name"] for u in plan.units][1:] == ["model.layers.0", "model.layers.1"]
    assert plan.peak_bytes[1] > plan.peak_bytes[2]
    gloo = fp.plan(str(tmp_path), world_size=[2], batch_size=2, seq_len=16, device="cpu").worlds[2]
    assert gloo.comm_buffers > plan.worlds[2].comm_buffers   # gloo stages full-size buffers in flight


def test_cli_json_and_fit(capsys):
    assert cli_main(["plan", "models:GPT", "--world", "1", "2", "--seq", "16", "--wrap", "Block", "--json",
                     "--device", "cuda"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_bytes"]["1"] > out["peak_bytes"]["2"]
    budget = out["peak_bytes"]["2"] + 1
    assert cli_main(["plan", "models:GPT", "--seq", "16", "--wrap", "Block", "--fit", str(budget), "--json",
                     "--max-world", "4", "--device", "cuda"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["fits"] and fit["world_size"] <= 2 and fit["peak_bytes"] <= budget
    assert cli_main(["plan", "no_such_module_xyz:factory"]) == 2


def test_bad_model_is_a_plan_error():
    with pytest.raises(PlanError, match="pkg.module:factory"):
        fp.plan("not a model")


def test_calibration_measures_each_kernel_class_and_predict_prices_each():
    """`calibrate` measures every rate on the transformer-layer workload (JSON round trip for the CLI and the
    benchmark), and `predict` divides each class of work by its own rate (None: the older fields)."""
    from fsdp_plugin.planner import Calibration, calibrate
    from fsdp_plugin.planner._time import predict

    cal = calibrate(torch.device("cpu"), seconds=0.02)
    rates = ("flops_per_s", "attention_flops_per_s", "elementwise_bytes_per_s", "optimizer_bytes_per_s",
             "mem_bytes_per_s", "op_overhead_s")
    assert all(getattr(cal, k) > 0 for k in rates), cal
    assert Calibration(**json.loads(json.dumps(cal.to_dict()))) == cal
    base = Calibration(flops_per_s=1e9, mem_bytes_per_s=1e9, bus_bytes_per_s=1e9, overlap=0.0,
                       attention_flops_per_s=0.5e9, elementwise_bytes_per_s=0.25e9, optimizer_bytes_per_s=2e9)
    t = predict(3e9, 1e9, 4e9, 0, 0, base, attention_flops=1e9)["step_s"]
    assert t == pytest.approx(2e9 / 1e9 + 1e9 / 0.5e9 + 1e9 / 0.25e9 + 4e9 / 2e9)
    named = Calibration(flops_per_s=1e9, mem_bytes_per_s=1e9, bus_bytes_per_s=1e9, overlap=0.0)
    assert predict(3e9, 1e9, 4e9, 0, 0, named, attention_flops=1e9)["step_s"] == pytest.approx(8.0)
    plan = _plan(world=(1,), calibration=base).worlds[1]
    slower = _plan(world=(1,), calibration=Calibration(**{**base.to_dict(), "attention_flops_per_s": 0.25e9}))
    assert slower.worlds[1].step_s > plan.step_s      # the model's attention is priced at the attention rate


def _calibrate_rank(rank, world):
    from fsdp_plugin.planner import calibrate
    return calibrate(torch.device("cpu"), seconds=0.02).to_dict()


def test_calibration_under_a_group_takes_the_median_of_the_ranks_rates():
    """Ranks sharing cores measure at different moments; every rank gets the median of the group's rates, so all
    ranks predict the same step time."""
    a, b = run_ranks(_calibrate_rank, 2, timeout=120)
    kernel = ("flops_per_s", "attention_flops_per_s", "elementwise_bytes_per_s", "optimizer_bytes_per_s",
              "mem_bytes_per_s", "op_overhead_s")
    assert {k: a[k] for k in kernel} == {k: b[k] for k in kernel}
    assert a["bus_bytes_per_s"] > 0 and "world 2" in a["source"]
