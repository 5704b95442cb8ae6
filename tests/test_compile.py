"""``fp.compile``: each innermost unit's forward compiled, hooks outside; fp32 parity with eager."""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from models import GPT, Block, gpt_batch

import fsdp_plugin as fp
from fsdp_plugin._build.compile import compiled_units


def _train(model, steps, rank=0, world=1):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(steps):
        x, y = gpt_batch(s, rank)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _make():
    torch.manual_seed(0)
    return fp.shard(GPT(vocab=64, d=32, n_layer=2, seq=16), auto_wrap_policy={Block})


def test_compile_per_unit_matches_eager_without_graph_breaks():
    """aot_eager: dynamo + AOTAutograd as inductor would see them, without code generation (fast)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    ref_losses, ref_params = _train(_make(), 3)
    model = fp.compile(_make(), backend="aot_eager")
    assert compiled_units(model) == ["blocks.0", "blocks.1"]  # the root (embeddings, head) stays eager
    losses, params = _train(model, 3)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(params, ref_params))
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # one graph for both blocks; new views each step: no recompile
    fp.compile(model, backend="eager")  # again: replaces the compilation, does not nest it
    assert model.blocks[0].forward._torchdynamo_orig_callable == model.blocks[0]._fp_eager_forward


def test_compile_needs_a_sharded_model():
    with pytest.raises(fp.ShardingError, match="fp.shard"):
        fp.compile(GPT())


def _inductor_rank(rank, world, compiled):
    torch.manual_seed(0)
    model = fp.shard(GPT(vocab=64, d=32, n_layer=2, seq=16), auto_wrap_policy={Block})
    if compiled:
        fp.compile(model)  # inductor (C++ on CPU)
    return _train(model, 3, rank, world)[0]


@pytest.mark.slow
def test_compile_inductor_world2_parity():
    eager = run_ranks(_inductor_rank, 2, False, timeout=300)
    compiled = run_ranks(_inductor_rank, 2, True, timeout=900)
    for a, b in zip(eager, compiled):
        assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-5


def test_lightning_compiled_module_is_compiled_per_unit_not_refused():
    pytest.importorskip("lightning")
    import lightning.pytorch as pl
    import lightning.pytorch.trainer.trainer as trainer_mod
    from lightning.pytorch.utilities.compile import from_compiled

    from fsdp_plugin.integrations.lightning import _compile
    from fsdp_plugin.integrations.lightning.strategy import FSDPPluginStrategy

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT(vocab=64, d=32, n_layer=2, seq=16)

        def forward(self, x, y):
            return self.gpt(x, y)

    lm = from_compiled(torch.compile(LM(), backend="eager"))  # what Trainer.fit does with a compiled model
    strategy = FSDPPluginStrategy(auto_wrap_policy={Block})
    trainer_mod._verify_strategy_supports_compile(lm, strategy)  # not refused
    ctx = _compile.take(lm)
    assert ctx is not None and lm._compiler_ctx is None
    fp.shard(lm, auto_wrap_policy={Block})
    _compile.apply(lm, ctx)
    assert compiled_units(lm) == ["gpt.blocks.0", "gpt.blocks.1"]
    x, y = gpt_batch(0, 0)
    assert abs(lm(x, y).item() - _make()(x, y).item()) <= 1e-6


def test_fabric_reapplied_compile_is_per_unit():
    pytest.importorskip("lightning")
    import lightning.fabric.fabric as fabric_mod

    from fsdp_plugin.integrations.lightning.fabric import FSDPPluginFabricStrategy

    FSDPPluginFabricStrategy()  # installs the per-unit compile step
    model = _make()
    assert fabric_mod._to_compiled(model, {"backend": "eager"}) is model  # what fabric.setup does after sharding
    assert compiled_units(model) == ["blocks.0", "blocks.1"]
    plain = torch.nn.Linear(2, 2)
    assert type(fabric_mod._to_compiled(plain, {"backend": "eager"})).__name__ == "OptimizedModule"


def test_accelerate_dynamo_backend_compiles_per_unit(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from fsdp_plugin.integrations.accelerate import Accelerator

    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.setenv(name, "false" if name != "ACCELERATE_MIXED_PRECISION" else "no")
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    # accelerate's state is a process-wide singleton: one an earlier test in this worker left initialized would
    # keep its own dynamo plugin and ignore dynamo_backend= (seen under xdist: no unit compiled)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        acc = Accelerator(sharding_config=fp.ShardingConfig(auto_wrap_policy={Block}), dynamo_backend="eager")
        assert acc.state.dynamo_plugin.backend.value.lower() == "eager", acc.state.dynamo_plugin
        torch.manual_seed(0)
        model = acc.prepare(GPT(vocab=64, d=32, n_layer=2, seq=16))
        assert fp.is_sharded(model) and compiled_units(model) == ["blocks.0", "blocks.1"]
        x, y = gpt_batch(0, 0)
        acc.backward(model(x, y))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
