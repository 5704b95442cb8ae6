"""The calibration times the planned model's own layer shapes (issue 35 deliverable 5, RESULTS § 35d/§ 35e: the
fixed small layer ran its matmuls 1.4x faster than the medium GPT's, and the planner under-predicted that model by
19-45%). Sizes read off models and micro-batches, recorded in ``Calibration.source``, passed by ``fp.plan`` and
``fp.planner.fit``; nothing here times the medium layer."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from fsdp_plugin.planner import LayerSizes, PlanError, _time, _workload, api
from fsdp_plugin.planner._layer_sizes import fitted
from models import GPT, Block

_RATES = {"flops_per_s": 1e10, "attention_flops_per_s": 1e10, "elementwise_bytes_per_s": 1e9,
          "optimizer_bytes_per_s": 1e9}


def _benchmark_model():
    """benchmarks/_model.py (the testbed's GPT and presets), loaded by path: benchmarks/ is not a package."""
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "_model.py"
    spec = importlib.util.spec_from_file_location("_bench_model", path)
    mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)    # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_sizes_of_the_benchmark_gpt_medium():
    bm = _benchmark_model()
    with torch.device("meta"):
        model = bm.GPT(bm.GPTConfig(**bm.PRESETS["medium"]))
    ids = torch.zeros(1, 128, dtype=torch.long)
    assert LayerSizes.of(model, (ids, ids)) == LayerSizes(batch=1, seq=128, width=768, heads=12, vocab=32768)
    default = LayerSizes.default()      # no micro-batch: the default layer's batch and sequence
    assert LayerSizes.of(model) == LayerSizes(default.batch, default.seq, 768, 12, 32768)


def test_sizes_of_a_transformers_model_from_its_config_and_input_ids():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    batch = {"attention_mask": torch.ones(3, 9, dtype=torch.long), "input_ids": torch.zeros(3, 9, dtype=torch.long),
             "labels": torch.zeros(3, 9, dtype=torch.long)}
    assert LayerSizes.of(model, batch) == LayerSizes(batch=3, seq=9, width=32, heads=4, vocab=96)


def test_sizes_fall_back_field_by_field():
    """No embedding, no head count, a float input: the default's width/vocab, width // 64 heads, default batch."""
    d = LayerSizes.default()
    assert LayerSizes.of(nn.Linear(4, 4), torch.zeros(2, 4)) == d
    wide = nn.Sequential(nn.Embedding(50, 640))
    assert LayerSizes.of(wide, [torch.zeros(5, 7, dtype=torch.int32)]) == LayerSizes(5, 7, 640, 10, 50)
    odd = nn.Sequential(nn.Embedding(50, 96))
    odd.n_head = 5                        # does not divide the width: not the layer's heads
    assert LayerSizes.of(odd).heads == 1


def test_sizes_are_validated_and_fitted_to_memory():
    with pytest.raises(PlanError, match="divisible by heads"):
        LayerSizes(1, 128, 768, 10, 100)
    with pytest.raises(PlanError, match="positive integers"):
        LayerSizes(0, 128, 768, 12, 100)
    cpu = torch.device("cpu")
    medium = LayerSizes(1, 128, 768, 12, 32768)
    assert fitted(medium, cpu) == medium                 # fits: timed as given
    big = fitted(LayerSizes(16, 2048, 8192, 64, 256000), cpu)
    assert 4 * big.batch * big.seq * big.vocab <= 256 * 2**20 and big.width % big.heads == 0
    assert big.width // big.heads == 128                 # the head dimension is kept


def test_calibrate_times_the_given_layer_and_names_it_in_the_source(monkeypatch):
    seen = []
    real = _workload._layer

    def layer(device, dtype, **sizes):
        seen.append(sizes)
        return real(device, dtype, **sizes)
    monkeypatch.setattr(_workload, "_layer", layer)
    cal = fp.planner.calibrate(torch.device("cpu"), seconds=0.01, layer=LayerSizes(2, 16, 64, 2, 128))
    assert seen == [dict(batch=2, seq=16, width=64, heads=2, vocab=128)]
    assert cal.source.endswith("layer batch 2 seq 16 width 64 heads 2 vocab 128"), cal.source
    assert cal.flops_per_s > 0 and cal.optimizer_bytes_per_s > 0


def _capture_measure(monkeypatch) -> list:
    """Replace the timed workload by a recorder of the sizes it is given, and shorten the other measurements."""
    seen = []

    def measure(device, dtype, seconds, sizes=None):
        seen.append(sizes)
        return dict(_RATES)
    monkeypatch.setattr(_workload, "measure", measure)
    real = _time.calibrate
    monkeypatch.setattr(api, "calibrate", lambda *a, **k: real(*a, **{**k, "seconds": 0.01}))
    return seen


def test_plan_calibrate_times_the_planned_models_layer(monkeypatch):
    seen = _capture_measure(monkeypatch)
    plan = fp.plan(lambda: GPT(vocab=64, d=32, n_layer=2, seq=16), world_size=1, auto_wrap_policy={Block},
                   inputs=lambda: (torch.randint(0, 64, (3, 16)),), device="cpu", calibration="calibrate")
    assert seen == [LayerSizes(batch=3, seq=16, width=32, heads=2, vocab=64)]
    assert "layer batch 3 seq 16 width 32 heads 2 vocab 64" in plan.calibration["source"]


def test_fit_calibrates_once_at_the_models_layer(monkeypatch):
    seen = _capture_measure(monkeypatch)
    fp.planner.fit(lambda: GPT(vocab=64, d=32, n_layer=2, seq=16), "1GB", max_world=2, auto_wrap_policy={Block},
                   batch_size=2, seq_len=8, device="cpu", calibration="calibrate")
    assert seen == [LayerSizes(batch=2, seq=8, width=32, heads=2, vocab=64)]
