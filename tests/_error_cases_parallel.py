"""The error catalogue's cases for tensor parallelism, weight streaming, TRL and quantized collectives
(tests/test_error_catalog.py lists them in CASES; split out to keep that file readable)."""
import torch
from torch import nn

import fsdp_plugin as fp
from _dist import RankFailure, run_ranks
from models import GPT


def _tp_error(case: str, cls):
    """Run the tensor-parallel refusal ``case`` of tests/_tp.py on 2 ranks (dp 1 x tp 2); re-raise its error."""
    import _tp
    try:
        run_ranks(getattr(_tp, case), 2)
    except RankFailure as e:
        prefix = f"{cls.__module__}.{cls.__name__}: "
        line = [ln for ln in str(e).splitlines() if ln.startswith(prefix)][0]
        raise cls(line.split(": ", 1)[1]) from None


def tensor_parallel_partial_parameter():
    _tp_error("refuse_partial", fp.TensorParallelError)


def tensor_parallel_over_two_mesh_dims():
    _tp_error("refuse_two_dims", fp.TensorParallelError)


def tensor_parallel_without_data_parallel_mesh():
    _tp_error("refuse_no_dp_mesh", fp.TensorParallelError)


def tensor_parallel_mesh_of_another_root():
    _tp_error("refuse_foreign_root", fp.TensorParallelError)


def tensor_parallel_model_wrapped_by_fsdp2():
    _tp_error("refuse_fsdp2", fp.TensorParallelError)


def per_tensor_optimizer_on_tensor_parallel_boxes():
    _tp_error("refuse_per_tensor_optimizer", fp.OptimizerError)


def device_mesh_smaller_than_world_without_tensor_parallelism():
    _tp_error("refuse_small_mesh_without_tp", fp.ConfigError)


def context_parallel_with_a_device_mesh_without_its_cp_dimension():
    _tp_error("refuse_cp_mesh_without_cp_dim", fp.ConfigError)


def lightning_fabric_with_tensor_parallel_size():
    from fsdp_plugin.integrations.lightning._plumbing import sharding_config
    sharding_config({"data_parallel_size": 2, "tensor_parallel_size": 2})


def lightning_parallel_sizes_not_matching_the_world():
    from fsdp_plugin.integrations.lightning import _tensor_parallel
    _tensor_parallel.resolve(2, 3, 1, 4)


def lightning_tensor_parallel_without_configure_model():
    import lightning.pytorch as pl
    from fsdp_plugin.integrations.lightning import _tensor_parallel
    _tensor_parallel.check_configured(pl.LightningModule())


def lightning_uneven_batches_with_tensor_parallelism():
    from fsdp_plugin.integrations.lightning import _tensor_parallel
    _tensor_parallel.refuse_uneven(2)


def lightning_configure_model_parallelized_nothing():
    from fsdp_plugin.integrations.lightning import _tensor_parallel
    _tensor_parallel.check_parallelized(nn.Linear(2, 2), 2)


def accelerate_tensor_parallel_without_dp_shard():
    from accelerate import ParallelismConfig
    from fsdp_plugin.integrations.accelerate import tensor_parallel
    tensor_parallel.dp_mesh(ParallelismConfig(tp_size=2), None)


def accelerate_tensor_parallel_model_without_plan():
    from fsdp_plugin.integrations.accelerate import tensor_parallel
    tensor_parallel.parallelize(nn.Linear(2, 2), None)


def accelerate_optimizer_stepped_before_tensor_parallel_prepare():
    from fsdp_plugin.integrations.accelerate import tensor_parallel
    model = nn.Linear(2, 2)
    before = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    model.weight = nn.Parameter(model.weight.detach().clone())     # what TP + fp.shard do to its parameters
    tensor_parallel.remap_optimizers([opt], before, model)


def plan_of_a_tensor_parallel_model():
    _tp_error("refuse_plan", fp.PlanError)


def plan_tp_size_not_dividing_the_world():
    fp.plan(GPT, world_size=3, tp_size=2, tp_plan={})


def plan_tp_plan_with_an_unknown_style():
    fp.plan(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4)), world_size=2, tp_size=2, tp_plan={"0": "diagonal"})
def _tiny_llama():
    import transformers as tf
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, num_key_value_heads=1))


def stream_with_unknown_names():
    fp.full_params_meta(_tiny_llama(), names="vllm")


def _stream_consumer_raises(rank, world):
    model = fp.shard(_tiny_llama())
    try:
        for _ in fp.iter_full_params(model):
            raise ConnectionResetError("the inference engine closed its socket")
    except ConnectionResetError:
        return None
    except fp.CollectiveError as e:
        return str(e)


def stream_consumer_fails_on_rank_0():
    """Rank 0's consumer raises while streaming: the other ranks raise this (no hang)."""
    raise fp.CollectiveError(run_ranks(_stream_consumer_raises, 2)[1])


def stream_merge_of_a_dora_adapter():
    import peft
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    fp.full_params_meta(model, merge_lora=True)


def trl_vllm_sync_on_an_unknown_trl_version():
    from types import SimpleNamespace

    import trl
    from fsdp_plugin.integrations.transformers import _trl

    saved, trl.__version__ = trl.__version__, "0.0.1"
    fake = type("GRPOTrainer", (), {"__module__": "trl.trainer.grpo_trainer"})()
    fake.args = SimpleNamespace(use_vllm=True)
    try:
        _trl.prepare(fake)
    finally:
        trl.__version__ = saved


def unknown_quantization_format():
    fp.Quantization(gradients="int2")


def quantization_block_size_not_a_multiple_of_8():
    fp.Quantization(weights="int8", block_size=100)


def quantized_weights_under_no_shard():
    fp.ShardingConfig(sharding_strategy="no_shard", quantization=fp.Quantization(weights="int8"))


def _experts_in_tp_plan(rank, world):
    """dp 2 x tp 2, a tiny Mixtral whose TP plan splits the experts' down_proj (rowwise), under expert_parallel=2."""
    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = tf.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = parallelize_hf(tf.MixtralForCausalLM(cfg), mesh["tp"], {"model.layers.*.mlp.experts.down_proj": "rowwise"})
    fp.shard(model, device_mesh=mesh["dp"], expert_parallel=2)


def expert_parallel_with_the_experts_in_the_tp_plan():
    try:
        run_ranks(_experts_in_tp_plan, 4)
    except RankFailure as e:
        line = [ln for ln in str(e).splitlines() if ln.startswith("fsdp_plugin.errors.ConfigError: ")][0]
        raise fp.ConfigError(line.split(": ", 1)[1]) from None
