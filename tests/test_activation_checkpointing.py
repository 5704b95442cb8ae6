"""`fp.Checkpointing`: every k-th module and torch's selective checkpointing, against no checkpointing.

Parity: same seed, different data per rank, every step's loss and the final state against one process on
the global batch (fp32, 1e-5). Mechanism: what is recomputed in backward is counted with a dispatch mode,
so a policy that silently degraded to whole-block (or to none) fails.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, make_optimizer, single_process, train
from fsdp_plugin._build.checkpointing import apply_activation_checkpointing
from models import GPT, Block, gpt_batch

STEPS = 3
POLICIES = {
    "selective": fp.Checkpointing(modules={Block}, selective=True),
    "every-2": fp.Checkpointing(modules={Block}, every=2),
    "selective-every-2": fp.Checkpointing(every=2, selective=True),   # modules=None: the units
}


def _worker(rank, world, ac, optim):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, activation_checkpointing=ac)
    opt = make_optimizer(optim, model.parameters())
    return train(model, opt, rank, world, STEPS), fp.full_state_dict(model)


@pytest.mark.parametrize("name,optim", [("selective", "sgd"), ("every-2", "sgd"), ("selective-every-2", "adamw")])
def test_checkpointing_policies_match_one_process(name, optim):
    losses, state = run_ranks(_worker, 2, POLICIES[name], optim)[0]
    want_losses, want_state = single_process(2, optim, steps=STEPS)
    assert_close_losses(losses, want_losses)
    assert_close_state(state, want_state)


class _CountMatmuls(TorchDispatchMode):
    """aten.mm/addmm calls, split by whether autograd was running backward (recomputation happens there)."""

    def __init__(self):
        super().__init__()
        self.forward = self.backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            if torch._C._current_graph_task_id() == -1:
                self.forward += 1
            else:
                self.backward += 1
        return func(*args, **(kwargs or {}))


def _matmuls(ac) -> tuple[int, int]:
    torch.manual_seed(0)
    model = GPT()
    wrapped = apply_activation_checkpointing(model, ac, units=list(model.blocks))
    x, y = gpt_batch(0, 0)
    with _CountMatmuls() as count:
        model(x, y).backward()
    return wrapped, count.forward, count.backward


def test_selective_keeps_matmul_outputs_and_every_k_skips_blocks():
    _, fwd, plain_bwd = _matmuls(None)
    per_block = 4   # attn, proj, fc, out (no early stop: the whole forward is recomputed)
    assert _matmuls({Block}) == (3, fwd, plain_bwd + 3 * per_block)         # whole block: matmuls again
    assert _matmuls(POLICIES["every-2"]) == (2, fwd, plain_bwd + 2 * per_block)   # blocks 0 and 2
    assert _matmuls(POLICIES["selective"]) == (3, fwd, plain_bwd)           # kept, not recomputed
    assert _matmuls(True) == (3, fwd, plain_bwd + 3 * per_block)            # True: every unit


def test_checkpointing_options_are_validated():
    with pytest.raises(fp.ConfigError, match="every"):
        fp.Checkpointing(modules={Block}, every=0)
    with pytest.raises(fp.ConfigError, match="activation_checkpointing"):
        fp.ShardingConfig(activation_checkpointing="blocks")
    with pytest.raises(fp.ConfigError, match="no other unit"):
        apply_activation_checkpointing(GPT(), fp.Checkpointing(), units=[])


def test_plan_knows_every_mode_and_the_cli_flags(capsys):
    import json

    from fsdp_plugin.cli import main as cli_main

    def peak(ac):
        return fp.plan(GPT, 2, auto_wrap_policy={Block}, activation_checkpointing=ac, seq_len=16, batch_size=8,
                       device="cpu").peak_bytes[2]
    none, block = peak(None), peak(True)
    selective, every2 = peak(fp.Checkpointing(selective=True)), peak(fp.Checkpointing({Block}, every=2))
    assert block < every2 < none and block < selective < none
    assert cli_main(["plan", "models:GPT", "--world", "2", "--seq", "16", "--batch", "8", "--wrap", "Block",
                     "--json", "--device", "cpu", "--activation-checkpointing", "--ac-selective"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"]["2"] == selective
    assert cli_main(["plan", "models:GPT", "--ac-every", "2"]) == 2


class _Sub(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class _Outer(torch.nn.Module):
    """A checkpointed unit whose last op is a nested unit (as MoE experts wrapped alone inside a block)."""

    def __init__(self):
        super().__init__()
        self.a, self.sub = torch.nn.Linear(8, 8), _Sub()

    def forward(self, x):
        return self.sub(torch.relu(self.a(x)))


def _nested_model():
    return torch.nn.Sequential(_Outer(), _Outer(), torch.nn.Linear(8, 1))


def _nested_worker(rank, world, ac):
    torch.manual_seed(0)
    model = fp.shard(_nested_model(), auto_wrap_policy={_Outer, _Sub}, activation_checkpointing=ac)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(3):
        loss = model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, fp.full_state_dict(model)


@pytest.mark.parametrize("selective", [False, True], ids=["block", "selective"])
def test_nested_unit_last_in_a_checkpointed_unit(selective):
    """torch's early stop of the recomputation used to reshard the nested unit mid-backward ("setStorage: ...
    out of bounds for storage of size 0"); recomputation must leave it gathered."""
    ac = fp.Checkpointing(modules={_Outer}, selective=selective)
    got = run_ranks(_nested_worker, 2, ac)
    want = run_ranks(_nested_worker, 2, None)
    for g, w in zip(got, want):
        assert_close_losses(g[0], w[0])
    assert_close_state(got[0][1], want[0][1])


def _hf_worker(rank, world, ac):
    from test_hf_activation_checkpointing import _llama, _step
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = fp.shard(_llama(), auto_wrap_policy={LlamaDecoderLayer}, activation_checkpointing=ac)
    _step(model, torch.arange(64).reshape(4, 16) % 64)   # same batch on every rank: averaged grads = local
    return {k: v.clone() for k, v in fp.full_state_dict(model).items()}


@pytest.mark.parametrize("ac", [fp.Checkpointing(selective=True), fp.Checkpointing(every=2, selective=True)],
                         ids=["selective", "selective-every-2"])
def test_hf_llama_selective_matches_unsharded(ac):
    pytest.importorskip("transformers")
    from test_hf_activation_checkpointing import _llama, _step

    got = run_ranks(_hf_worker, 2, ac)[0]
    ref = _llama()
    _step(ref, torch.arange(64).reshape(4, 16) % 64)
    assert_close_state(got, ref.state_dict())
