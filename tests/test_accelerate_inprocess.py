"""The Accelerator subclass in this process (world 1, no launcher): selection paths, errors, no-pickle load."""
from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")
from fsdp_plugin.integrations.accelerate import AccelerateConfigError, Accelerator

import fsdp_plugin as fp


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return torch.relu(self.lin(x))


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Block(), Block(), nn.Linear(6, 1))


@pytest.fixture(autouse=True)
def fresh_accelerate(monkeypatch):
    """Isolate accelerate's singletons and the env variables our Accelerator/plugins set."""
    from accelerate.state import AcceleratorState, GradientState

    for name in ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.setenv(name, "false" if name != "ACCELERATE_MIXED_PRECISION" else "no")
    AcceleratorState._reset_state(True)     # a test of another file in this pytest process may have left them
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_unsupported_env_value_fails_before_accelerate_starts(monkeypatch):
    from accelerate.state import PartialState

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "true")
    with pytest.raises(AccelerateConfigError, match=r"fsdp_config\.fsdp_activation_checkpointing_offload"):
        Accelerator()
    assert not PartialState._shared_state  # nothing was initialized


def test_plugin_object_in_code_shards_with_our_engine():
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=False,
                                            auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Block"], cpu_ram_efficient_loading=False)
    acc = Accelerator(fsdp_plugin=plugin)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    assert fp.is_sharded(model) and getattr(acc.state, "fsdp_plugin", None) is None  # torch FSDP never built
    cfg = acc.sharding_configs[0]
    assert cfg.sharding_strategy == "shard_grad_op" and cfg.auto_wrap_policy == {Block}
    loss = model(torch.randn(3, 4)).sum()
    acc.backward(loss)
    assert torch.isfinite(acc.clip_grad_norm_(model.parameters(), 1.0))
    acc.clip_grad_value_(model.parameters(), 0.01)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01


def test_sharding_config_in_code_and_no_pickle_on_load(tmp_path, monkeypatch):
    acc = Accelerator(sharding_config=fp.ShardingConfig(sharding_strategy="no_shard"))
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = acc.prepare(model, opt, sched)
    acc.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    sched.step()
    acc.save_state(tmp_path / "s")
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    sched.step()

    def refuse(*a, **k):
        raise AssertionError("pickle used on a load path")

    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    acc.load_state(tmp_path / "s")
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), expected[n])
    assert sched.get_last_lr() == [0.05] and acc.step == 0
    assert not [p for p in (tmp_path / "s").rglob("*") if p.suffix in (".bin", ".pkl", ".pt")]


def test_bf16_flag_gives_bf16_params_fp32_reduction_on_cpu():
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    acc = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin)
    model = acc.prepare(net())
    mp = acc.sharding_configs[0].mixed_precision
    assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32  # accelerate's autocast wrapper returns fp32 outputs
    acc.backward(out.sum())
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_save_state_rejects_an_optimizer_of_an_unprepared_model(tmp_path):
    acc = Accelerator(sharding_config=fp.ShardingConfig())
    model = acc.prepare(net())
    stray = acc.prepare(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    assert fp.is_sharded(model) and stray is not None
    with pytest.raises(ValueError, match="SGD.*hold no parameter of a prepared model"):
        acc.save_state(tmp_path / "s")


def test_automatic_checkpoint_naming_and_total_limit(tmp_path):
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    acc = Accelerator(sharding_config=fp.ShardingConfig(), project_config=project)
    assert fp.is_sharded(acc.prepare(net()))
    for _ in range(3):
        acc.save_state()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2"]
    acc.load_state()  # the newest


def test_full_state_dict_type_also_writes_full_hf_weights(tmp_path):
    """fsdp_state_dict_type FULL_STATE_DICT: save_state adds the full weights as HF safetensors."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from safetensors.torch import load_file

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False,
                                            state_dict_type="FULL_STATE_DICT")
    acc = Accelerator(fsdp_plugin=plugin)
    assert acc.fsdp_settings.state_dict_type == "full"
    model = acc.prepare(net())
    acc.save_state(tmp_path / "s")
    full = load_file(tmp_path / "s" / "full_model_0" / "model.safetensors")
    want = fp.full_state_dict(model)
    assert sorted(full) == sorted(want) and all(torch.equal(full[k], want[k]) for k in want)
    assert (tmp_path / "s" / "model_0" / "manifest.json").is_file()  # load_state resumes from the sharded state
    acc.load_state(tmp_path / "s")


def test_prepare_model_muon_and_adamw_trains_and_resumes(tmp_path):
    """prepare(model, muon, adamw) with the optimizers built before sharding (accelerate's order)."""
    acc = Accelerator(sharding_config=fp.ShardingConfig())
    model = net()
    mats = [p for n, p in model.named_parameters() if n.endswith("lin.weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("lin.weight")]
    muon, adamw = fp.optim.Muon(mats, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)
    model, muon, adamw = acc.prepare(model, muon, adamw)
    assert fp.is_sharded(model)
    for _ in range(2):
        acc.backward(model(torch.randn(3, 4)).pow(2).sum())
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    inner = muon.optimizer if hasattr(muon, "optimizer") else muon
    assert all("momentum_buffer" in inner.state[p] for p in mats)
    acc.save_state(tmp_path / "s")
    want = {id(p): inner.state[p]["momentum_buffer"].clone() for p in mats}
    for p in mats:
        inner.state[p]["momentum_buffer"].zero_()
    acc.load_state(tmp_path / "s")
    assert all(torch.equal(inner.state[p]["momentum_buffer"], want[id(p)]) for p in mats)
