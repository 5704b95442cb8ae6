"""fp32 masters by default under 16-bit mixed precision (`MixedPrecision.master_dtype`), for a model loaded
in bf16: trainable parameters get fp32 shards (so fp32 optimizer state), frozen ones stay as loaded, and
training equals one process that keeps fp32 masters and casts them to bf16 for each forward/backward."""
import torch

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import assert_close_losses, assert_close_state, same_casts_reference, train
from models import GPT, Block, gpt_batch

BF16 = fp.MixedPrecision(param_dtype=torch.bfloat16)
STEPS = 4


def _bf16_gpt():
    return GPT().to(torch.bfloat16)


def _parity_worker(rank, world):
    torch.manual_seed(0)
    model = fp.shard(_bf16_gpt(), auto_wrap_policy={Block}, mixed_precision=BF16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}, "trainable bf16 params get fp32 masters"
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    dtypes = []
    losses = train(model, opt, rank, world, STEPS, each=lambda s, loss: dtypes.append(loss.dtype))
    assert set(dtypes) == {torch.bfloat16}, "compute stays bf16"
    return losses, fp.full_state_dict(model)


def test_bf16_loaded_model_trains_like_fp32_masters_with_bf16_compute():
    want_losses, want_state = same_casts_reference(2, STEPS, torch.bfloat16,
                                                   model_fn=lambda: _bf16_gpt().float())
    losses, state = run_ranks(_parity_worker, 2)[0]
    assert_close_losses(losses, want_losses)
    assert_close_state(state, want_state)
    assert {v.dtype for v in state.values()} == {torch.float32}


def _dtypes_worker(rank, world, master_dtype):
    torch.manual_seed(0)
    model = _bf16_gpt()
    model.blocks[0].requires_grad_(False)     # a frozen base: must not be doubled
    mp = fp.MixedPrecision(param_dtype=torch.bfloat16, master_dtype=master_dtype)
    fp.shard(model, auto_wrap_policy={Block}, mixed_precision=mp)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss = model(*gpt_batch(0, rank))
    loss.backward()
    opt.step()
    frozen = {p.dtype for p in model.blocks[0].parameters()}
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    moments = {opt.state[p][k].dtype for p in opt.state for k in ("exp_avg", "exp_avg_sq")}
    return frozen, trainable, grads, moments


def test_frozen_params_stay_as_loaded_and_adam_state_is_fp32():
    frozen, trainable, grads, moments = run_ranks(_dtypes_worker, 2, torch.float32)[0]
    assert frozen == {torch.bfloat16}
    assert trainable == grads == moments == {torch.float32}


def test_master_dtype_none_keeps_bf16_masters():
    frozen, trainable, grads, moments = run_ranks(_dtypes_worker, 2, None)[0]
    assert frozen == trainable == grads == moments == {torch.bfloat16}


def test_master_dtype_rule():
    assert BF16.master_dtype_for(torch.bfloat16, True) == torch.float32
    assert BF16.master_dtype_for(torch.bfloat16, False) == torch.bfloat16     # frozen: as loaded
    assert BF16.master_dtype_for(torch.float32, True) == torch.float32
    assert BF16.master_dtype_for(torch.int64, True) == torch.int64
    no_low = fp.MixedPrecision(reduce_dtype=torch.float32)                     # no 16-bit compute: as loaded
    assert no_low.master_dtype_for(torch.bfloat16, True) == torch.bfloat16


def test_plan_counts_fp32_masters_for_a_bf16_model():
    def shard_bytes(model_fn, mp):
        p = fp.plan(model_fn, 2, auto_wrap_policy={Block}, mixed_precision=mp, inputs=lambda: torch.zeros(
            2, 16, dtype=torch.long))
        return p.worlds[2]
    upcast = shard_bytes(_bf16_gpt, BF16)
    as_fp32 = shard_bytes(GPT, BF16)
    kept = shard_bytes(_bf16_gpt, fp.MixedPrecision(param_dtype=torch.bfloat16, master_dtype=None))
    assert upcast.peak == as_fp32.peak
    assert kept.peak < upcast.peak


def _checkpoint_worker(rank, world, path):
    import json
    import os

    from safetensors import safe_open

    from fsdp_plugin.checkpoint.format import _format

    torch.manual_seed(0)
    model = _bf16_gpt()
    model.blocks[0].requires_grad_(False)
    fp.shard(model, auto_wrap_policy={Block}, mixed_precision=BF16)
    fp.save_checkpoint(os.path.join(path, "ckpt"), model)
    fp.save_pretrained(model, os.path.join(path, "hf"), dtype=torch.bfloat16)
    doc = json.load(open(os.path.join(path, "ckpt", "manifest.json")))
    said = {n: doc["params"][n]["dtype"] for n in ("blocks.0.fc.weight", "blocks.1.fc.weight")}
    with safe_open(os.path.join(path, "hf", "model.safetensors"), "pt") as f:
        exported = {f.get_tensor(k).dtype for k in f.keys()}
    # a resume with bf16 masters (master_dtype=None) reads the fp32 checkpoint, cast
    torch.manual_seed(1)
    again = fp.shard(_bf16_gpt(), auto_wrap_policy={Block},
                     mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16, master_dtype=None))
    fp.load_checkpoint(os.path.join(path, "ckpt"), again)
    want = {k: v.to(torch.bfloat16) for k, v in fp.full_state_dict(model).items()}
    got = fp.full_state_dict(again)
    same = all(torch.equal(got[k], want[k]) and got[k].dtype == torch.bfloat16 for k in want)
    return said, exported, same, _format.dtype_name(torch.float32), _format.dtype_name(torch.bfloat16)


def test_checkpoint_says_its_dtypes_and_hf_export_casts(tmp_path):
    said, exported, same, f32, b16 = run_ranks(_checkpoint_worker, 2, str(tmp_path))[0]
    assert said == {"blocks.0.fc.weight": b16, "blocks.1.fc.weight": f32}
    assert exported == {torch.bfloat16}
    assert same


def test_entry_points_get_fp32_masters_for_bf16_compute():
    from fsdp_plugin.integrations.accelerate.config.resolve import mixed_precision
    from fsdp_plugin.integrations.accelerate.config.settings import FsdpSettings
    from fsdp_plugin.integrations.lightning._precision_map import precision_spec

    # accelerate `mixed_precision: bf16` (and so the Trainer's bf16=True), Lightning "bf16-mixed"
    for mp in (mixed_precision(FsdpSettings(mixed_precision="bf16")), precision_spec("bf16-mixed").mixed_precision()):
        assert mp.master_dtype_for(torch.bfloat16, True) == torch.float32
        assert mp.master_dtype_for(torch.bfloat16, False) == torch.bfloat16
    # Lightning "bf16-true" means bf16 everywhere, masters included (as Lightning's own FSDP): no policy
    spec = precision_spec("bf16-true")
    assert spec.module_dtype == torch.bfloat16 and spec.mixed_precision() is None


def _deferred_worker(rank, world):
    torch.manual_seed(0)
    with fp.deferred_init():
        model = _bf16_gpt()
    fp.shard(model, auto_wrap_policy={Block}, mixed_precision=BF16)
    return {p.dtype for p in model.parameters()}, fp.full_state_dict(model)


def test_deferred_bf16_model_gets_the_same_fp32_masters():
    dtypes, state = run_ranks(_deferred_worker, 2)[0]
    torch.manual_seed(0)
    want = _bf16_gpt().float().state_dict()
    assert dtypes == {torch.float32}
    assert_close_state(state, want, tol=0)
