"""Exports of a 2-D (dp x tp) model (issue 31): HF safetensors from fp.save_pretrained / model.save_pretrained
with no gather to one rank, read back by transformers' from_pretrained bit-exactly equal to full_state_dict."""
import os

import pytest
import torch

from _dist import run_ranks
import _tp
import _tp_export


def _read_dir(d) -> dict:
    from safetensors.torch import load_file
    out = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(d, f)))
    return out


def _equal(got: dict, want: dict, what: str):
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{what}: {k}"


def test_save_pretrained_of_a_2d_llama_loads_in_transformers(tmp_path):
    """2 dp x 2 tp Llama after one step: fp.save_pretrained and model.save_pretrained load with
    LlamaForCausalLM.from_pretrained equal to full_state_dict bit for bit; model.save_pretrained's files are
    byte-identical to transformers' own save of the gathered model, also when the boxes go to rank 0 (a rank
    not seeing the files), and gather=True writes fp.save_pretrained's bytes; the default paths send nothing
    point-to-point (each rank writes its own boxes) and none falls back to gathering the model on rank 0."""
    from transformers import LlamaForCausalLM
    results = run_ranks(_tp_export.save_pretrained_worker, 4, str(tmp_path), timeout=300)
    full, sends, gathered = results[0]
    assert not any(r[2] for r in results), "a save fell back to the rank-0 gather"
    assert all(r[1]["fp"] == 0 and r[1]["hf"] == 0 for r in results), [r[1] for r in results]
    assert sum(r[1]["fp_gather"] for r in results) > 0 and sum(r[1]["hf_p2p"] for r in results) > 0
    assert sum(f.endswith(".safetensors") for f in os.listdir(tmp_path / "fp")) > 2   # split into files
    for name in ("fp", "hf"):
        loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / name)).state_dict()
        _equal({k: loaded[k] for k in full}, full, name)
    ref = _tp.llama()
    ref.load_state_dict(full)
    ref.save_pretrained(str(tmp_path / "ref"), max_shard_size="8KB")
    for got, want in (("hf", "ref"), ("hf_p2p", "ref"), ("fp_gather", "fp")):   # the same bytes every way
        assert sorted(os.listdir(tmp_path / got)) == sorted(os.listdir(tmp_path / want)), got
        for f in sorted(os.listdir(tmp_path / want)):
            assert (tmp_path / got / f).read_bytes() == (tmp_path / want / f).read_bytes(), (got, f)


@pytest.mark.parametrize("dp_shape", [(2,), (1, 2)])
def test_save_pretrained_of_the_toy_gpt_writes_every_box(tmp_path, dp_shape):
    """Uneven colwise (9 | 8) and rowwise boxes, each cut into dp rows, TP-replicated tensors written once;
    full_shard 2 x 2 and hybrid (1, 2) x 2."""
    results = run_ranks(_tp_export.toy_save_worker, 4, str(tmp_path / "out"), dp_shape, timeout=240)
    _equal(_read_dir(tmp_path / "out"), results[0], "toy GPT")


def _same(got: dict, want: dict, what: str):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} off by {(got[k] - want[k]).abs().max().item():.3e}"


@pytest.mark.parametrize("layout", ["2x2", "4x1", "h1x2x2"])
def test_fsdp2_tp_dcp_checkpoint_resumes_on_ours(tmp_path, layout):
    """torch's FSDP2 + the same TP plan at 2 x 2, dcp.save: ours at 2 x 2 (and 4 dp without TP, and hybrid
    (1, 2) x tp 2) loads it with
    every parameter and Adam moment bit-exact, and the next step's loss matches torch's within 1e-5."""
    path = str(tmp_path / "dcp")
    want, want_loss = run_ranks(_tp_export.torch_save_worker, 4, path, timeout=300)[0]
    for got, loss in run_ranks(_tp_export.ours_load_worker, 4, path, layout, timeout=300):
        _same(got, want, layout)
        assert abs(loss[0] - want_loss[0]) <= 1e-5, (loss, want_loss)


def test_ours_exported_to_dcp_loads_into_fsdp2_tp(tmp_path):
    """Ours at 2 x 2, fp.save_checkpoint, `fsdp-plugin export --format dcp`: torch's FSDP2 + TP dcp.load gets
    every parameter and Adam moment bit-exact, and its next step's loss matches ours within 1e-5."""
    from fsdp_plugin.cli import main
    want, want_loss = run_ranks(_tp_export.ours_save_worker, 4, str(tmp_path / "ours"), timeout=300)[0]
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "dcp"), "--format", "dcp"]) == 0
    for got, loss in run_ranks(_tp_export.torch_load_worker, 4, str(tmp_path / "dcp"), timeout=300):
        _same(got, want, "FSDP2 + TP")
        assert abs(loss[0] - want_loss[0]) <= 1e-5, (loss, want_loss)


def _plan_args(which: str) -> dict:
    if which == "toy":
        return dict(model=_tp.TPGPT, auto_wrap_policy={_tp.TPBlock}, inputs=lambda: _tp.batch(0, 0),
                    tp_plan=_tp.tp_plan())
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    idx = _tp.llama_batch(0, 0)
    return dict(model=_tp.llama, auto_wrap_policy={LlamaDecoderLayer}, tp_plan="auto",
                inputs=lambda: {"input_ids": idx, "labels": idx})


@pytest.mark.parametrize("strategy,which,feature", [("full_shard", "toy", ""), ("shard_grad_op", "toy", ""),
                                                     ("full_shard", "toy", "ac"), ("full_shard", "toy", "bf16"),
                                                     ("full_shard", "llama", "")])
def test_plan_2d_predicts_dp_bytes_and_shard_memory_of_the_engine(strategy, which, feature):
    """fp.plan(model before parallelize_module, world_size=4, tp_size=2, tp_plan=the plan): the dp dimension's
    bytes per step equal fp.comm_stats on the ranks of TP coordinate 0 (the larger boxes: 9 of the toy's 17 MLP
    columns; the Llama from its own tp_plan, tp_plan='auto'), also under activation checkpointing (recomputed
    forward collectives, early-stopped as torch's checkpoint does) and bf16 (16-bit activations and gradients), and their flat shard bytes equal the engine's; AdamW state (the planner counts the padded chunk,
    the engine the parameters' elements) is reached by the worst rank; coordinate 1's are no larger."""
    import fsdp_plugin as fp
    args = _plan_args(which)
    model = args.pop("model")
    args.update(_tp_export.FEATURES[feature][0])
    plan = fp.plan(model, world_size=4, sharding_strategy=strategy, tp_size=2, **args)
    w = plan.worlds[4]
    assert w.tp_size == 2 and plan.num_params == sum(p.numel() for p in model().parameters())
    results = run_ranks(_tp_export.plan_worker, 4, strategy, which, feature, timeout=240)
    for rank, (wire, shards, state, (tp_bytes, tp_calls)) in enumerate(results):
        assert (tp_bytes, tp_calls) == (w.tp_wire_bytes, w.tp_wire_calls), (rank, tp_bytes, w.tp_wire_bytes)
        if rank % 2 == 0:
            assert wire == w.wire_bytes, (rank, wire, w.wire_bytes)
            assert shards == w.param_shards, rank
        else:
            assert sum(wire.values()) <= w.wire_total and shards <= w.param_shards, rank
        assert state <= w.optimizer_state, rank
    assert max(r[2] for r in results) == w.optimizer_state
    args.pop("tp_plan")
    plain = fp.plan(model, world_size=4, sharding_strategy=strategy, **args)
    assert plain.worlds[4].wire_total > 2 * w.wire_total     # the 4 x 1 plan is not what was predicted


def test_plan_cli_with_tp_size(capsys):
    """`fsdp-plugin plan MODEL --world 4 --tp-size 2 --tp-plan MOD:FN` prints the 2-D plan fp.plan gives."""
    import json
    import fsdp_plugin as fp
    from fsdp_plugin.cli import main
    assert main(["plan", "_tp:TPGPT", "--world", "4", "--wrap", "TPBlock", "--inputs", "_tp_export:toy_inputs",
                 "--tp-size", "2", "--tp-plan", "_tp:tp_plan", "--device", "cpu", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["worlds"]["4"]
    want = fp.plan(_tp.TPGPT, world_size=4, auto_wrap_policy={_tp.TPBlock}, inputs=_tp_export.toy_inputs,
                   tp_size=2, tp_plan=_tp.tp_plan(), device="cpu").worlds[4]
    assert got["tp_size"] == 2 and got["tp_wire_bytes"] == want.tp_wire_bytes and got["wire_bytes"] == want.wire_bytes
    assert main(["plan", "_tp:TPGPT", "--world", "3", "--tp-size", "2", "--tp-plan", "_tp:tp_plan"]) == 2


@pytest.mark.parametrize("which", ["toy", "llama"])
def test_iter_full_params_of_a_2d_model_yields_full_tensors(which):
    """fp.iter_full_params at 2 x 2: every TP slot all-gathered over TP after the dp gather, on every rank; equal
    to full_state_dict bit for bit, shapes as full_params_meta says (per unit and bucketed)."""
    for full, got, hf, meta in run_ranks(_tp_export.stream_worker, 4, which, timeout=240):
        _equal(got, {k: v for k, v in full.items() if k in got}, "names='module'")
        assert set(got) == set(full)
        assert [(n, tuple(t.shape), t.dtype) for n, t in hf.items()] == [(n, tuple(s), d) for n, s, d in meta]
        for n, t in hf.items():
            assert torch.equal(t, full[n]), n
