"""``context_parallel`` from the integrations' own settings, on 2 forked gloo ranks (no launcher): accelerate's
``parallelism_config_cp_size`` (the env ``accelerate launch`` exports), the transformers Trainer under it,
Lightning's ``Trainer.fit`` and Fabric with ``context_parallel=2`` train like one process, and their data loaders
give every rank of a CP group the same samples (the data-parallel view)."""
from __future__ import annotations

import os

import pytest
import torch
import transformers as tf
from _dist import run_ranks

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

VOCAB, SEQ, N, BATCH = 96, 13, 4, 2
ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
       "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
       "FSDP_SYNC_MODULE_STATES": "false", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
       "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "localhost", "MASTER_PORT": "0",
       "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1",
       "PARALLELISM_CONFIG_CP_SIZE": "2"}


def _build():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tf.LlamaForCausalLM(cfg).train()


def _samples():
    return torch.randint(0, VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(3))


def _reference():
    model, ids = _build(), _samples()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6)
    losses = []
    for i in range(0, N, BATCH):
        loss = model(input_ids=ids[i:i + BATCH], labels=ids[i:i + BATCH]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _accelerate(rank, world, extra_env=None):
    os.environ.update({**ENV, **(extra_env or {})})
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    import fsdp_plugin as fp
    from fsdp_plugin.integrations.accelerate import Accelerator

    acc = Accelerator()
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6)
    loader = torch.utils.data.DataLoader(_samples(), batch_size=BATCH)
    model, opt, loader = acc.prepare(model, opt, loader)
    assert acc.context_parallel == 2 and acc.num_processes == world
    assert (fp.data_parallel_rank(model), fp.data_parallel_size(model)) == (0, 1)
    seen, losses = [], []
    for ids in loader:
        seen.append(ids.tolist())
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = fp.full_state_dict(model)
    calls = {k: fp.comm_stats.calls[k] for k in ("cp_kv", "cp_kv_ring", "cp_ulysses")}
    return seen, losses, {n: v for n, v in full.items() if n in dict(model.named_parameters())}, calls


# accelerate's cp_comm_strategy (the launcher's env) or our variable → the attention mode that ran: the collective
# each mode alone issues (cp_kv: K/V all-gather, cp_kv_ring: K/V rotation, cp_ulysses: all-to-all over heads)
MODES = {"allgather": ({}, "cp_kv"), "alltoall": ({"PARALLELISM_CONFIG_CP_COMM_STRATEGY": "alltoall"}, "cp_kv_ring"),
         "ulysses": ({"FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION": "ulysses"}, "cp_ulysses")}


@pytest.mark.parametrize("mode", list(MODES))
def test_accelerate_cp_size_trains_like_one_process(mode):
    extra, issued = MODES[mode]
    (seen0, losses0, params, calls), (seen1, losses1, _, _) = run_ranks(_accelerate, 2, extra, timeout=180)
    assert [k for k, n in calls.items() if n] == [issued], calls
    assert seen0 == seen1 == _samples().view(-1, BATCH, SEQ).tolist(), "a CP pair must read the same batches"
    want_losses, want = _reference()
    for got in (losses0, losses1):
        assert max(abs(a - b) for a, b in zip(got, want_losses)) <= 1e-5, (got, want_losses)
    assert params.keys() == want.keys()
    for n, v in want.items():
        assert (params[n] - v).abs().max().item() <= 1e-5, n


def test_accelerate_settings_map_cp_size():
    """cp_size becomes fp.ShardingConfig.context_parallel; parameters shard over dp_shard x cp; with tp_size the
    ParallelismConfig stays accelerate's; sp_size is refused by name."""
    pytest.importorskip("accelerate")
    from fsdp_plugin.integrations.accelerate.config.from_env import settings_from_env
    s = settings_from_env({**ENV, "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2", "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2"})
    assert (s.context_parallel, s.mesh, s.strategy) == (2, (2, 4), "hybrid_shard")
    import fsdp_plugin as fp
    s = settings_from_env({**ENV, "PARALLELISM_CONFIG_TP_SIZE": "2"})   # cp x tp: accelerate's mesh, see
    assert (s.context_parallel, s.tensor_parallel, s.mesh) == (2, True, None)  # test_accelerate_context_tensor_parallel
    with pytest.raises(fp.ConfigError, match="sp_size"):
        settings_from_env({**ENV, "PARALLELISM_CONFIG_SP_SIZE": "2"})
    # a ParallelismConfig in code: the same mapping, and stock accelerate never sees it (its own CP stays off)
    import accelerate
    from fsdp_plugin.integrations.accelerate.config.selection import _apply_parallelism
    from fsdp_plugin.integrations.accelerate.config.settings import FsdpSettings
    settings, bound = FsdpSettings(), {"parallelism_config": accelerate.ParallelismConfig(
        dp_replicate_size=2, dp_shard_size=2, cp_size=2)}
    _apply_parallelism(settings, bound)
    assert (settings.context_parallel, settings.mesh, settings.strategy, bound) == (2, (2, 4), "hybrid_shard", {})


def test_accelerate_comm_strategy_selects_the_attention_mode(monkeypatch):
    """cp_handler's cp_comm_strategy ("allgather" → allgather, torch's rotating "alltoall" → ring), from the
    launcher's env and from a ParallelismConfig in code; FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION picks Ulysses (which
    accelerate lacks), and a contradiction or an unknown value is refused naming the key."""
    import accelerate
    from accelerate.utils import TorchContextParallelConfig

    import fsdp_plugin as fp
    from fsdp_plugin.integrations.accelerate.config.from_env import settings_from_env
    from fsdp_plugin.integrations.accelerate.config.resolve import sharding_kwargs
    from fsdp_plugin.integrations.accelerate.config.selection import _apply_parallelism
    from fsdp_plugin.integrations.accelerate.config.settings import FsdpSettings
    var, comm = "FSDP_PLUGIN_CONTEXT_PARALLEL_ATTENTION", "PARALLELISM_CONFIG_CP_COMM_STRATEGY"
    for env, want in (({}, "allgather"), ({comm: "allgather"}, "allgather"), ({comm: "alltoall"}, "ring"),
                      ({var: "ulysses"}, "ulysses"), ({var: "Ring"}, "ring"), ({comm: "alltoall", var: "ring"}, "ring")):
        assert settings_from_env({**ENV, **env}).context_parallel_attention == want, env
    s = settings_from_env({**ENV, comm: "alltoall"})
    assert sharding_kwargs(s, _build())["context_parallel_attention"] == "ring"
    for env, key in (({comm: "alltoall", var: "ulysses"}, var), ({var: "zigzag"}, var), ({comm: "ring"}, "cp_comm")):
        with pytest.raises(fp.ConfigError, match=key):
            settings_from_env({**ENV, **env})
    monkeypatch.delenv(comm, raising=False)
    monkeypatch.delenv(var, raising=False)
    for strategy, want in (("allgather", "allgather"), ("alltoall", "ring")):
        settings = FsdpSettings()
        _apply_parallelism(settings, {"parallelism_config": accelerate.ParallelismConfig(
            dp_shard_size=1, cp_size=2, cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy))})
        assert (settings.context_parallel, settings.context_parallel_attention) == (2, want)
    monkeypatch.setenv(var, "ulysses")
    settings = FsdpSettings()
    _apply_parallelism(settings, {"parallelism_config": accelerate.ParallelismConfig(dp_shard_size=1, cp_size=2)})
    assert settings.context_parallel_attention == "ulysses"


def test_lightning_sampler_uses_the_data_parallel_view():
    """FSDPPluginStrategy(context_parallel=2) and Fabric's strategy at world 4: rank 3 samples as dp rank 1 of 2."""
    pytest.importorskip("lightning")
    from lightning.fabric.plugins.environments import LightningEnvironment

    from fsdp_plugin.integrations.lightning.fabric import FSDPPluginFabricStrategy
    from fsdp_plugin.integrations.lightning.strategy import FSDPPluginStrategy
    env = LightningEnvironment()
    env.set_global_rank(3)
    env.set_world_size(4)
    for cls in (FSDPPluginStrategy, FSDPPluginFabricStrategy):
        strategy = cls(context_parallel=2, context_parallel_attention="ring",
                       parallel_devices=[torch.device("cpu")] * 4, cluster_environment=env)
        assert (strategy.sharding_config.context_parallel, strategy.sharding_config.context_parallel_attention) == (
            2, "ring")
        assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_lightning_refuses_context_parallel_with_tensor_parallel():
    """FSDPPluginStrategy's 2-D (data_parallel, tensor_parallel) mesh has no CP dimension: refused when the
    strategy is built, naming the accelerate and engine-API recipes; each alone is accepted."""
    pytest.importorskip("lightning")
    import fsdp_plugin as fp
    from fsdp_plugin.integrations.lightning.strategy import FSDPPluginStrategy
    with pytest.raises(fp.UnsupportedError, match=r"context_parallel=2, tensor_parallel_size=2.*cp_size.*mesh\['dp', 'cp'\]"):
        FSDPPluginStrategy(context_parallel=2, tensor_parallel_size=2)
    FSDPPluginStrategy(context_parallel=2)
    FSDPPluginStrategy(tensor_parallel_size=2)


def _trainer(out):
    """A transformers Trainer run on the samples: (loss, grad_norm) per step (constant lr, max_grad_norm 1)."""
    args = tf.TrainingArguments(out, per_device_train_batch_size=BATCH, max_steps=N // BATCH, learning_rate=2e-3,
                                lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[],
                                use_cpu=True, seed=0, data_seed=0)
    trainer = tf.Trainer(model=_build(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in _samples()])
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


def _trainer_rank(rank, world, out):
    os.environ.update(ENV)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    from fsdp_plugin.integrations.transformers import install
    install()
    return _trainer(out)


def test_hf_trainer_with_cp_size_matches_one_process(tmp_path):
    """The Trainer under accelerate's env with parallelism_config_cp_size 2: its num_items_in_batch (gathered over
    every rank, so counting each sample twice) and its loss scale (x world) cancel, and its loaders go through
    our data-parallel view; logged loss and grad norm equal the plain single-process Trainer's."""
    want = _trainer(str(tmp_path / "ref"))
    got = run_ranks(_trainer_rank, 2, str(tmp_path / "cp"), timeout=180)
    for rank in got:
        assert len(rank) == len(want) == N // BATCH
        for (loss, norm), (wloss, wnorm) in zip(rank, want):
            assert abs(loss - wloss) <= 1e-5 and abs(norm - wnorm) <= 1e-5, (rank, want)


def _fabric(rank, world):
    from lightning.fabric import Fabric

    from fsdp_plugin.integrations.lightning.fabric import FSDPPluginFabricStrategy
    fabric = Fabric(accelerator="cpu", devices=world, strategy=FSDPPluginFabricStrategy(context_parallel=2))
    fabric.launch()        # the fork harness made the processes and the process group: adopted
    model = fabric.setup_module(_build())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=2e-3, eps=1e-6))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(_samples(), batch_size=BATCH))
    seen, losses = [], []
    for ids in loader:
        seen.append(ids.tolist())
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return seen, losses


def test_fabric_context_parallel_trains_like_one_process():
    """Lightning Fabric with FSDPPluginFabricStrategy(context_parallel=2) on 2 ranks: its DistributedSampler
    gives both ranks every sample (one data-parallel rank), and the losses are one process's."""
    pytest.importorskip("lightning")
    (seen0, losses0), (seen1, losses1) = run_ranks(_fabric, 2, timeout=180)
    assert seen0 == seen1 and len(seen0) == N // BATCH
    want, _ = _reference()
    for got in (losses0, losses1):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


def _lightning(rank, world):
    import lightning as L

    from fsdp_plugin.integrations.lightning.strategy import FSDPPluginStrategy

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.seen, self.losses = _build(), [], []

        def training_step(self, ids, index):
            self.seen.append(ids.tolist())
            loss = self.model(input_ids=ids, labels=ids).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=2e-3, eps=1e-6)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(_samples(), batch_size=BATCH)

    module = Module()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=FSDPPluginStrategy(context_parallel=2),
                        max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module)      # the LightningModule is sharded; the split hooks the transformers model inside it
    return module.seen, module.losses


def test_lightning_trainer_context_parallel_trains_like_one_process():
    pytest.importorskip("lightning")
    (seen0, losses0), (seen1, losses1) = run_ranks(_lightning, 2, timeout=180)
    assert seen0 == seen1 and len(seen0) == N // BATCH
    want, _ = _reference()
    for got in (losses0, losses1):
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
