"""Per-module precision (`MixedPrecision.fp32_modules`, and a model's own ``_keep_in_fp32_modules``).

Reference (one process, the recipe a user writes by hand): fp32 master; each rank's batch runs on a copy whose
parameters are bf16 except the fp32 modules' (fp32 from the master), whose 16-bit inputs are cast to fp32 and
fp32 outputs back to bf16; gradients summed in fp32 over the ranks' batches and averaged. The sharded run must
equal it within 1e-5 per step (losses and final parameters); both compute in bf16 with the same ops, so in
practice the difference is float noise of the reduction order at most. Each parity test also shows that it can
fail: plain bf16 (no fp32 modules) is farther than the tolerance from the same reference.
"""
import copy
import json
import os
import re

import pytest
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, global_mean, make_optimizer, train
from models import GPT, Block, gpt_batch

BF16 = torch.bfloat16
LN_FP32 = fp.MixedPrecision(param_dtype=BF16, fp32_modules=(nn.LayerNorm,))
STEPS = 4


def _by_hand(master: nn.Module, keep_fp32) -> nn.Module:
    """The compute copy of the reference: bf16 except the modules ``keep_fp32(name, module)`` selects (fp32
    parameters from the master; inputs cast up, outputs cast down, as the user would do by hand)."""
    low = copy.deepcopy(master)
    kept = [m for n, m in low.named_modules() if keep_fp32(n, m)]
    kept_params = {id(p) for m in kept for p in m.parameters()}
    for p in low.parameters():
        if id(p) not in kept_params:
            p.data = p.data.to(BF16)
    for m in kept:
        m.register_forward_pre_hook(lambda mod, args: tuple(a.float() if a.dtype == BF16 else a for a in args))
        m.register_forward_hook(lambda mod, args, out: out.to(BF16) if out.dtype == torch.float32 else out)
    return low


def _reference(world, optim, model_fn, low_fn, batch_fn=gpt_batch, steps=STEPS):
    torch.manual_seed(0)
    master = model_fn()
    opt = make_optimizer(optim, master.parameters())
    losses = []
    for s in range(steps):
        low = low_fn(master)
        total = [torch.zeros_like(p) for p in master.parameters()]
        step_loss = 0.0
        for r in range(world):
            low.zero_grad()
            loss = _loss(low, batch_fn(s, r))
            loss.backward()
            for acc, p in zip(total, low.parameters()):
                acc.add_(p.grad.float())
            step_loss += loss.float().item() / world
        for p, acc in zip(master.parameters(), total):
            p.grad = acc / world
        opt.step()
        losses.append(step_loss)
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def _loss(model, batch):
    if isinstance(batch, dict):
        return model(**batch).loss
    return model(*batch)


# ----------------------------------------------------------------------------- a norm kept fp32 in bf16 blocks
def _gpt_worker(rank, world, optim, mp):
    torch.manual_seed(0)
    model = GPT()
    seen = {}

    ln, inner = model.blocks[0].ln2, model.blocks[0].ln2.forward

    def norm_forward(x):       # what the norm's own forward sees (fp.shard wraps it with the casts)
        out = inner(x)
        seen.setdefault("ln", (x.dtype, ln.weight.dtype, out.dtype))
        return out

    def fc_input(m, args):
        seen.setdefault("fc_in", args[0].dtype)
    ln.forward = norm_forward
    model.blocks[0].fc.register_forward_pre_hook(fc_input)
    fp.shard(model, auto_wrap_policy={Block}, mixed_precision=mp)
    opt = make_optimizer(optim, model.parameters())
    losses = train(model, opt, rank, world, STEPS)
    return losses, fp.full_state_dict(model), seen


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_norms_kept_fp32_inside_bf16_units_match_the_hand_written_recipe(optim):
    want_losses, want_state = _reference(2, optim, GPT, lambda m: _by_hand(m, lambda n, x: isinstance(x, nn.LayerNorm)))
    losses, state, seen = run_ranks(_gpt_worker, 2, optim, LN_FP32)[0]
    assert seen == {"ln": (torch.float32,) * 3, "fc_in": BF16}, "fp32 inside the norm, bf16 after it"
    assert_close_losses(losses, want_losses)
    assert_close_state(state, want_state)
    _, plain, _ = run_ranks(_gpt_worker, 2, optim, fp.MixedPrecision(param_dtype=BF16))[0]
    _assert_drifts(plain, want_state, "plain bf16 norms")


def _assert_drifts(state, want, what):
    """The control: ``state`` (trained without the fp32 rule) is farther than the tolerance from ``want``.
    (Parameters, not losses: a bf16 loss is quantized to 2^-5 near 4, so losses alone rarely tell.)"""
    drift = max((state[k].float() - want[k].float()).abs().max().item() for k in want)
    assert drift > 1e-4, f"{what} are only {drift:.1e} from the recipe: the parity test could not fail"


# ------------------------------------------------------------------------------------------------- wire bytes
def _wire_worker(rank, world, mp):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, mixed_precision=mp)
    handles = [h for u in model._fp_root.units for h in u.handles]
    gathers = {id(h): 0 for h in handles}
    for h in handles:
        def counted(*args, _h=h, _inner=h.unshard, **kwargs):
            gathers[id(_h)] += _h.unshard_communicates
            return _inner(*args, **kwargs)
        h.unshard = counted
    opt = torch.optim.AdamW(model.parameters())
    for step in range(2):          # the second step: the execution order is known (as fp.plan assumes)
        gathers.update(dict.fromkeys(gathers, 0))
        fp.comm_stats.reset()
        model(*gpt_batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    ring = fp.comm_stats.bytes
    want_gather = sum(gathers[id(h)] * h.padded * h.compute_dtype.itemsize // 2 for h in handles)
    want_reduce = sum(h.padded * h.reduce_dtype.itemsize // 2 for h in handles)
    fp32_names = {s.fqn for h in handles if h.compute_dtype == torch.float32 for s in h.slots}
    low = {h.compute_dtype for h in handles if not {s.fqn for s in h.slots} & fp32_names}
    return dict(ring), want_gather, want_reduce, fp32_names, low


def test_wire_bytes_are_bf16_except_the_fp32_modules_parameters():
    ring, want_gather, want_reduce, fp32_names, low = run_ranks(_wire_worker, 2, LN_FP32)[0]
    norms = {n for n, m in GPT().named_modules() if isinstance(m, nn.LayerNorm)}
    assert fp32_names == {f"{n}.{p}" for n in norms for p in ("weight", "bias")}
    assert low == {BF16}
    assert ring["all_gather"] == want_gather and ring["reduce_scatter"] == want_reduce
    plain, _, _, _, _ = run_ranks(_wire_worker, 2, fp.MixedPrecision(param_dtype=BF16))[0]
    assert plain["all_gather"] < ring["all_gather"] < 2 * plain["all_gather"]
    plan = fp.plan(GPT, world_size=2, auto_wrap_policy={Block}, mixed_precision=LN_FP32, optimizer="adamw",
                   inputs=lambda: gpt_batch(0, 0))
    assert plan.worlds[2].wire_bytes["all_gather"] == ring["all_gather"]
    assert plan.worlds[2].wire_bytes["reduce_scatter"] == ring["reduce_scatter"]


# ------------------------------------------------------------------------- checkpoints say which dtype they hold
def _checkpoint_worker(rank, world, path):
    from fsdp_plugin.checkpoint.format import _format

    mp = fp.MixedPrecision(param_dtype=BF16, master_dtype=None, fp32_modules=(nn.LayerNorm,))
    torch.manual_seed(0)
    model = fp.shard(GPT().to(BF16), auto_wrap_policy={Block}, mixed_precision=mp)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, world, 1)
    fp.save_checkpoint(os.path.join(path, "ckpt"), model)
    doc = json.load(open(os.path.join(path, "ckpt", "manifest.json")))
    said = {n: doc["params"][n]["dtype"] for n in ("blocks.0.ln1.weight", "blocks.0.fc.weight")}
    torch.manual_seed(1)
    again = fp.shard(GPT().to(BF16), auto_wrap_policy={Block}, mixed_precision=mp)
    fp.load_checkpoint(os.path.join(path, "ckpt"), again)
    want, got = fp.full_state_dict(model), fp.full_state_dict(again)
    same = all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    return said, same, model.blocks[0].ln1.weight.dtype, _format.dtype_name(torch.float32), _format.dtype_name(BF16)


def test_checkpoint_round_trip_keeps_the_fp32_modules_masters(tmp_path):
    said, same, ln_dtype, f32, b16 = run_ranks(_checkpoint_worker, 2, str(tmp_path))[0]
    # master_dtype=None keeps bf16 masters for the bf16 blocks; the fp32 norms train (and save) in fp32
    assert ln_dtype == torch.float32
    assert said == {"blocks.0.ln1.weight": f32, "blocks.0.fc.weight": b16}
    assert same


# ------------------------------------------------------- transformers' own _keep_in_fp32_modules(_strict)
VOCAB = 96


def _glm_moe():
    import transformers as tf
    cfg = tf.Glm4MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=0, max_position_embeddings=64)
    torch.manual_seed(0)
    return tf.Glm4MoeForCausalLM(cfg)


def _lm_batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (2, 8), generator=g)
    return {"input_ids": ids, "labels": ids}


def _declared(name: str) -> bool:
    """transformers' rule for Glm4-MoE's _keep_in_fp32_modules_strict under bf16, written out independently."""
    return any(re.search(p, name) for p in ("gate.weight", "e_score_correction_bias"))


def _by_transformers_rule(master: nn.Module) -> nn.Module:
    """What from_pretrained(dtype=torch.bfloat16) leaves: bf16 except the declared parameters (fp32)."""
    low = copy.deepcopy(master)
    for n, p in low.named_parameters():
        if not _declared(n):
            p.data = p.data.to(BF16)
    return low


def test_transformers_keep_in_fp32_modules_strict_is_honoured_by_default():
    want_losses, want_state = _reference(2, "sgd", _glm_moe, _by_transformers_rule, batch_fn=_lm_batch)
    losses, state, fp32 = run_ranks(_hf_worker, 2, True)[0]
    assert fp32 == ["model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"]
    assert_close_losses(losses, want_losses)
    assert_close_state(state, want_state)
    _, plain, fp32_off = run_ranks(_hf_worker, 2, False)[0]
    assert fp32_off == []
    _assert_drifts(plain, want_state, "bf16 routers")


def _train_kwargs(model, opt, rank, world, steps):
    """`_parity.train` for a model called with keyword batches (input_ids, labels) that returns ``.loss``."""
    losses = []
    for s in range(steps):
        loss = model(**_lm_batch(s, rank)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(global_mean(loss, world))
    return losses


def _hf_worker(rank, world, honour):
    model = _glm_moe()
    if not honour:
        model._keep_in_fp32_modules_strict = None      # transformers' own opt-out
    fp.shard(model, mixed_precision=fp.MixedPrecision(param_dtype=BF16))
    handles = [h for u in model._fp_root.units for h in u.handles]
    fp32 = sorted(s.fqn for h in handles if h.compute_dtype == torch.float32 for s in h.slots)
    losses = _train_kwargs(model, make_optimizer("sgd", model.parameters()), rank, world, STEPS)
    return losses, fp.full_state_dict(model), fp32


# ---------------------------------------------------------------------------------------- the dtype rule
class _Declares(GPT):
    _keep_in_fp32_modules = ["ln_f"]          # transformers: kept fp32 under fp16 only
    _keep_in_fp32_modules_strict = ["blocks.0.ln1"]   # under fp16 and bf16


def _rule_worker(rank, world):
    out = {}
    for dtype in (torch.float16, BF16):
        model = fp.shard(_Declares(), auto_wrap_policy={Block}, mixed_precision=fp.MixedPrecision(param_dtype=dtype))
        out[dtype] = sorted(s.fqn for u in model._fp_root.units for h in u.handles
                            if h.compute_dtype == torch.float32 for s in h.slots)
    return out


def test_declared_lists_follow_transformers_dtype_rule():
    out = run_ranks(_rule_worker, 2)[0]
    strict = ["blocks.0.ln1.bias", "blocks.0.ln1.weight"]
    assert out[BF16] == strict
    assert out[torch.float16] == sorted(strict + ["ln_f.bias", "ln_f.weight"])


def test_fp32_modules_values():
    assert fp.MixedPrecision(param_dtype=BF16, fp32_modules=nn.LayerNorm).fp32_modules == (nn.LayerNorm,)
    assert fp.MixedPrecision(param_dtype=BF16, fp32_modules={"b", "a"}) == \
        fp.MixedPrecision(param_dtype=BF16, fp32_modules=("a", "b"))
    for bad in (nn.Linear(2, 2), int, "", "(", [nn.LayerNorm, 3]):
        with pytest.raises(fp.ConfigError, match="fp32_modules"):
            fp.MixedPrecision(param_dtype=BF16, fp32_modules=bad)
    with pytest.raises(fp.ConfigError, match="16-bit"):
        fp.MixedPrecision(fp32_modules=(nn.LayerNorm,))


# ------------------------------------------------- torch FSDP1's per-module switch, through the integrations
def _batchnorm_worker(rank, world):
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision   # the baseline's type, tests only

    from fsdp_plugin.integrations.accelerate.config.torch_fsdp_args import mixed_precision

    mp = mixed_precision(TorchMixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32, buffer_dtype=BF16))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    fp.shard(model, auto_wrap_policy={nn.Linear}, mixed_precision=mp)
    out = model(torch.randn(6, 4))
    out.float().sum().backward()
    root = model._fp_root.units[0]
    return (mp.fp32_modules, {h.compute_dtype for h in root.handles}, model[1].running_mean.dtype, out.dtype,
            model[1].weight.grad.dtype)


def test_fsdp1_module_classes_to_ignore_become_fp32_modules():
    """torch FSDP1 runs ``MixedPrecision._module_classes_to_ignore`` (default: BatchNorm) outside mixed
    precision; the one translator (Lightning's FSDP kwargs, accelerate's plugin) maps it to fp32_modules."""
    keep, dtypes, running, out, grad = run_ranks(_batchnorm_worker, 2)[0]
    assert keep == (torch.nn.modules.batchnorm._BatchNorm,)
    assert dtypes == {torch.float32}          # the root unit holds just the BatchNorm
    assert running == torch.float32 and grad == torch.float32      # buffer_dtype skips it
    assert out == BF16
