"""Tensor parallelism inside units (issue 31): a DTensor model parallelized on mesh['tp'] and sharded over the
data-parallel dims trains like one process on the global batch, per step within 1e-5 (loss, full gradients,
full parameters), at world 4 = 2 dp x 2 tp on gloo."""
import pytest
import torch

from _dist import RankFailure, run_ranks
import _tp

STEPS = 3
_REF: dict = {}


def ref(dp, optim, clip=None):
    if (dp, optim, clip) not in _REF:
        _REF[dp, optim, clip] = _tp.reference(dp, optim, STEPS, clip)
    return _REF[dp, optim, clip]


@pytest.mark.parametrize("strategy,dp_shape,optim", [
    ("full_shard", (2,), "adamw"), ("full_shard", (2,), "sgd"), ("shard_grad_op", (2,), "sgd"),
    ("hybrid_shard", (1, 2), "adamw"), ("no_shard", (2,), "sgd"),
])
def test_2d_matches_one_process(strategy, dp_shape, optim):
    results = run_ranks(_tp.worker, 4, dp_shape, 2, optim, STEPS, strategy, timeout=240)
    for got in results:
        _tp.assert_matches(got, ref(2, optim))


def test_clip_grad_norm_exact_over_dp_and_tp():
    """Clipping at a norm below the gradients' counts TP-sharded boxes over TP and replicated ones once."""
    results = run_ranks(_tp.worker, 4, (2,), 2, "sgd", STEPS, "full_shard", 0.05, timeout=240)
    want = ref(2, "sgd", 0.05)
    assert all(w[3] > 0.05 for w in want), "the clip must bite for the test to mean anything"
    for got in results:
        _tp.assert_matches(got, want)


def test_comparison_can_fail():
    """A reference at another dp size (other global batch) is caught."""
    got = run_ranks(_tp.worker, 4, (2,), 2, "sgd", 1, "full_shard", timeout=240)[0]
    with pytest.raises(AssertionError):
        _tp.assert_matches(got, _tp.reference(1, "sgd", 1))


@pytest.mark.parametrize("case,error,words", [
    ("refuse_partial", "TensorParallelError", "Partial"),
    ("refuse_strided", "TensorParallelError", "strided"),
    ("refuse_two_dims", "TensorParallelError", "more than one mesh dimension"),
    ("refuse_no_dp_mesh", "TensorParallelError", "device_mesh=mesh['dp']"),
    ("refuse_foreign_root", "TensorParallelError", "one root mesh"),
    ("refuse_fsdp2", "TensorParallelError", "fully_shard"),
    ("refuse_per_tensor_optimizer", "OptimizerError", "tensor parallelism"),
    ("refuse_stale_optimizer", "OptimizerError", "after fp.shard"),
    ("refuse_small_mesh_without_tp", "ConfigError", "tensor-parallel model"),
    ("refuse_plan", "PlanError", "tp_plan="),
])
def test_refused_layouts_name_the_fix(case, error, words):
    with pytest.raises(RankFailure) as e:
        run_ranks(getattr(_tp, case), 2, timeout=120)
    assert f"{error}: " in str(e.value) and words in str(e.value), str(e.value)[-3000:]


def test_transformers_llama_with_its_own_tp_plan():
    """LlamaForCausalLM (tiny config, nothing downloaded), model.tp_plan as transformers applies it
    (embedding_rowwise, colwise q/k/v/gate/up, rowwise o/down, colwise_gather_output head), GQA 4/2 heads."""
    results = run_ranks(_tp.llama_worker, 4, STEPS, timeout=300)
    want = _tp.llama_reference(2, STEPS)
    for got in results:
        _tp.assert_matches(got, want)


def _initial() -> dict:
    torch.manual_seed(0)
    return {k: v.detach() for k, v in _tp.TPGPT().named_parameters()}


@pytest.mark.parametrize("feature,tol", [("bf16", 3e-2), ("checkpointing", 1e-5), ("no_sync", 1e-5)])
def test_features_on_a_tp_model(feature, tol):
    """Mixed precision, activation checkpointing and no_sync accumulation on 2 dp x 2 tp give the gradients
    of one fp32 process on the global batch; fp.full_params shows the full (DTensor) parameters."""
    loss, grads, params, _ = ref(2, "sgd")[0]
    for got_loss, got_grads, got_params in run_ranks(_tp.features_worker, 4, feature, timeout=240):
        if feature != "no_sync":
            assert abs(got_loss - loss) <= tol
        for k in grads:
            scale = max(1.0, grads[k].abs().max().item())
            assert (got_grads[k] - grads[k]).abs().max().item() <= tol * scale, k
        assert set(got_params) == set(grads)
        for k, v in _initial().items():
            assert torch.equal(got_params[k], v), k


@pytest.mark.parametrize("on_meta", [False, True])
def test_load_pretrained_reads_tp_boxes(tmp_path, on_meta):
    """fp.load_pretrained fills each rank's dp rows of its TP box straight from HF safetensors (ranged reads),
    also into a model parallelized on the meta device and sharded with param_init_fn='skip'."""
    from safetensors.torch import save_file
    want = {k: v.contiguous() for k, v in _tp.llama().state_dict().items()}
    save_file(want, str(tmp_path / "model.safetensors"))
    for got in run_ranks(_tp.llama_load_worker, 4, str(tmp_path), on_meta, timeout=300):
        assert set(got) >= set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k


def test_unit_collectives_run_on_dp_groups_over_local_boxes():
    """fp.comm_stats counts the engine's own traffic only (TP's collectives are its own): one reduce-scatter per
    handle over the 2 dp ranks of its flat buffer, which holds local TP boxes (TP-split layers halved)."""
    total = sum(p.numel() for p in _tp.TPGPT().parameters())
    for rank, (calls, nbytes, handles, want, local) in enumerate(run_ranks(_tp.comm_worker, 4, timeout=240)):
        assert calls == handles and nbytes == want, (rank, calls, handles, nbytes, want)
        assert local < total * 0.8     # most of the toy GPT is TP-split


def test_transformers_moe_attention_tp_and_packed_experts_refused():
    """Mixtral (4 experts, top 2): its tp_plan without the expert entries (experts whole on every TP rank, dp
    sharded) trains like one process; the full plan's packed_colwise experts (a _StridedShard) are refused by
    name, not trained wrongly."""
    want = _tp.hf_reference(_tp.mixtral, 2, 2)
    for got in run_ranks(_tp.hf_worker, 4, "mixtral", "MixtralDecoderLayer", 2, "experts", timeout=300):
        _tp.assert_matches(got, want)
    with pytest.raises(RankFailure) as e:
        run_ranks(_tp.hf_worker, 4, "mixtral", "MixtralDecoderLayer", 1, timeout=300)
    assert "TensorParallelError" in str(e.value) and "packed_colwise" in str(e.value)
