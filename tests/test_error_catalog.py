"""docs/errors.md is generated from these cases, so the documented messages cannot drift.

Regenerate after changing a message: FSDP_PLUGIN_WRITE_ERROR_DOCS=1 python -m pytest tests/test_error_catalog.py
"""
import os

import torch
from torch import nn

import fsdp_plugin as fp
from _dist import RankFailure, run_ranks
from models import GPT, Block
from _error_cases_parallel import (  # tensor parallel, streaming, TRL, quantization
    tensor_parallel_partial_parameter,
    tensor_parallel_over_two_mesh_dims,
    tensor_parallel_without_data_parallel_mesh,
    tensor_parallel_mesh_of_another_root,
    tensor_parallel_model_wrapped_by_fsdp2,
    per_tensor_optimizer_on_tensor_parallel_boxes,
    device_mesh_smaller_than_world_without_tensor_parallelism,
    context_parallel_with_a_device_mesh_without_its_cp_dimension,
    lightning_fabric_with_tensor_parallel_size,
    lightning_parallel_sizes_not_matching_the_world,
    lightning_tensor_parallel_without_configure_model,
    lightning_uneven_batches_with_tensor_parallelism,
    lightning_configure_model_parallelized_nothing,
    accelerate_tensor_parallel_without_dp_shard,
    accelerate_tensor_parallel_model_without_plan,
    accelerate_optimizer_stepped_before_tensor_parallel_prepare,
    plan_of_a_tensor_parallel_model,
    plan_tp_size_not_dividing_the_world,
    plan_tp_plan_with_an_unknown_style,
    stream_with_unknown_names,
    stream_consumer_fails_on_rank_0,
    stream_merge_of_a_dora_adapter,
    trl_vllm_sync_on_an_unknown_trl_version,
    unknown_quantization_format,
    quantization_block_size_not_a_multiple_of_8,
    quantized_weights_under_no_shard,
    expert_parallel_with_the_experts_in_the_tp_plan)
from _error_cases_dcp import (  # DCP conversion, checkpoint directories
    dcp_metadata_naming_a_foreign_global,
    truncated_dcp_data_file,
    dcp_save_interrupted,
    dcp_optimizer_groups_differ,
    export_dcp_onto_an_existing_directory,
    load_a_directory_that_is_not_a_checkpoint,
    load_an_interrupted_save)

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "errors.md")


def unknown_strategy():
    fp.ShardingConfig(sharding_strategy="zero3")


def unknown_option():
    fp.shard(GPT(), reshard_after_forwards=True)


def bad_reshard_after_forward():
    fp.ShardingConfig(reshard_after_forward="last")


def _hpz_not_dividing(rank, world):
    fp.shard(GPT(), auto_wrap_policy={Block}, reshard_after_forward=3)


def hpz_size_not_dividing_the_shard_group():
    try:
        run_ranks(_hpz_not_dividing, 2)
    except RankFailure as e:
        line = [ln for ln in str(e).splitlines() if ln.startswith("fsdp_plugin.errors.ConfigError: ")][0]
        raise fp.ConfigError(line.split("ConfigError: ", 1)[1]) from None


def hpz_size_below_one():
    fp.ShardingConfig(reshard_after_forward=0)


def plan_nodes_not_dividing_the_world():
    fp.plan(GPT, world_size=4, nodes=3, link_gbps=1)
def unknown_pairing_check():
    fp.ShardingConfig(pairing_check="fast")


def wrap_policy_matches_nothing():
    class Missing(nn.Module):
        pass
    fp.shard(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), auto_wrap_policy={Missing})


def bad_fp32_modules_value():
    fp.MixedPrecision(param_dtype=torch.bfloat16, fp32_modules=[nn.LayerNorm, 3])


def fp32_modules_match_nothing():
    fp.shard(GPT(), mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16, fp32_modules=("RMSNorm",)))


def fp32_modules_without_16_bit_compute():
    fp.MixedPrecision(fp32_modules=(nn.LayerNorm,))


def fp32_module_tied_to_a_16_bit_module():
    fp.shard(GPT(), mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16, fp32_modules=("head",)))


def _mesh(rank, world):
    fp.shard(GPT(), sharding_strategy="hybrid_shard", device_mesh=(3, 1))


def mesh_not_dividing_world():
    try:
        run_ranks(_mesh, 2)
    except RankFailure as e:
        line = [ln for ln in str(e).splitlines() if ln.startswith("fsdp_plugin.errors.ConfigError: ")][0]
        raise fp.ConfigError(line.split("ConfigError: ", 1)[1]) from None


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class _WithTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.tower, self.head = nn.Linear(4, 4), _Tower(), nn.Linear(4, 1)

    def forward(self, x, image=None):
        h = self.embed(x)
        return self.head(h if image is None else h + self.tower(image)).sum()


def _tower_on_rank0(rank, world):
    model = fp.shard(_WithTower(), auto_wrap_policy={_Tower}, timeout_s=30)
    try:
        model(torch.ones(2, 4), torch.ones(2, 4) if rank == 0 else None).backward()
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def a_unit_runs_on_some_ranks_only():
    """Rank 0 holds an image, rank 1 does not; the tower is a unit but not in some_ranks_modules."""
    raise fp.CollectiveError(run_ranks(_tower_on_rank0, 2, timeout=60)[0])


def some_ranks_modules_matches_nothing():
    fp.shard(_WithTower(), some_ranks_modules={"VisionTower"})


def _llava_images_renamed(rank, world):
    from test_some_ranks_on_demand import _Renamed
    from test_some_ranks_vlm import rank_batch

    model = fp.shard(_Renamed(), timeout_s=30)
    batch = rank_batch(2, rank)        # images on both ranks, under a name the default does not know
    try:
        model(batch["input_ids"], batch["pixel_values"])
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def default_tower_fed_under_an_unknown_input_name():
    """A VLM's tower (gathered on demand by default) runs although no rank's inputs named pixel_values."""
    raise fp.CollectiveError(run_ranks(_llava_images_renamed, 2, timeout=60)[0])


def plan_of_a_forward_that_reads_integers_from_its_inputs():
    """Qwen2-VL with images reads its image grid sizes with .tolist(): a fake run has no data."""
    import test_some_ranks_qwen2vl as q
    fp.plan(q.tiny_qwen2vl, 2, inputs=lambda: q.collate([q.sample(0), q.sample(1)]))


def shard_twice():
    model = fp.shard(GPT(), auto_wrap_policy={Block})
    fp.shard(model)




def dtype_backend_cannot_reduce():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = nn.Linear(2, 2).to(torch.complex64)
    fp.shard(model)


def plain_state_dict_on_sharded_model():
    fp.shard(nn.Sequential(nn.Linear(2, 2)), auto_wrap_policy={nn.Linear}).state_dict()


def not_sharded():
    with fp.no_sync(nn.Linear(2, 2)):
        pass


def meta_module_without_init():
    with torch.device("meta"):
        model = GPT()
    fp.shard(model, auto_wrap_policy={Block})


def transformers_init_leaves_module_unset():
    import transformers as tf

    class Scale(nn.Module):   # no reset_parameters(), and transformers' generic _init_weights ignores it
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.ones(4))

    class Tiny(tf.PreTrainedModel):
        config_class = tf.PretrainedConfig

        def __init__(self, config):
            super().__init__(config)
            self.scale = Scale()
            self.post_init()

    with torch.device("meta"):
        model = Tiny(tf.PretrainedConfig())
    fp.shard(model)


def skip_cannot_fill_nonpersistent_buffer():
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    with torch.device("meta"):
        model = Rotary()
    fp.shard(model, param_init_fn="skip")


def nonfinite_gradients_with_clipping():
    model = fp.shard(nn.Sequential(nn.Linear(2, 2)))
    model(torch.tensor([[float("inf"), 1.0]])).sum().backward()
    fp.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)


def checkpoint_from_another_architecture(tmp_path):
    fp.save_checkpoint(str(tmp_path / "ckpt"), fp.shard(nn.Sequential(nn.Linear(3, 3))))
    fp.load_checkpoint(str(tmp_path / "ckpt"), fp.shard(nn.Sequential(nn.Linear(3, 4))))


def lightning_fsdp_option_without_equivalent():
    from fsdp_plugin.integrations.lightning._fsdp_kwargs import translate

    translate({"use_orig_params": False})


def lightning_torch_checkpoint_not_ours(tmp_path):
    from fsdp_plugin.integrations.lightning.checkpoint import torch_file as _torch_file

    torch.save({"state_dict": {"w": torch.ones(1)}}, tmp_path / "model.ckpt")
    _torch_file.read(tmp_path / "model.ckpt")


def trainer_resume_from_foreign_folder(tmp_path):
    import pytest

    pytest.importorskip("transformers")
    import sys

    was_installed = "fsdp_plugin.integrations.transformers" in sys.modules
    import fsdp_plugin.integrations.transformers as hf
    from fsdp_plugin.integrations.transformers import _checkpoint

    was_installed = was_installed and hf.is_installed()
    try:
        _checkpoint.load(None, str(tmp_path))
    finally:
        if not was_installed:  # importing it patched transformers.Trainer in this process: undo that only
            hf.uninstall()


def compile_unsharded_model():
    fp.compile(nn.Linear(2, 2))


def unknown_async_save_mode(tmp_path):
    fp.save_checkpoint(tmp_path / "ckpt", nn.Linear(2, 2), async_save="background")


def plan_of_an_unknown_model():
    fp.plan("my_project.models.build")


def materialize_a_tensor_that_is_not_deferred():
    from fsdp_plugin._deferred import materialize
    with torch.device("meta"):
        t = torch.empty(3)
    materialize([t], torch.device("cpu"))


def checkpoint_extra_that_needs_pickle(tmp_path):
    fp.save_checkpoint(str(tmp_path / "ckpt"), fp.shard(nn.Linear(2, 2)), extra={"fn": print})


def checkpoint_url_without_filesystem():
    fp.save_checkpoint("nosuchscheme://bucket/run/step1", fp.shard(nn.Linear(2, 2)))


def export_dcp_to_a_url_holding_objects(tmp_path):
    import uuid

    import fsspec
    from fsdp_plugin.checkpoint.dcp import export_dcp

    fp.save_checkpoint(str(tmp_path / "ckpt"), fp.shard(nn.Linear(2, 2)))
    out = f"memory://b{uuid.uuid4().hex[:12]}/export"
    fsspec.filesystem("memory").pipe(out + "/notes.txt", b"someone else's object")
    try:
        export_dcp(str(tmp_path / "ckpt"), out)
    except fp.CheckpointError as e:
        raise fp.CheckpointError(str(e).replace(out, "s3://bucket/export")) from None


def checkpoint_replaced_by_another_save_while_uploading():
    """Two saves replace one checkpoint at once; the second to publish fails its conditional write (If-Match on S3;
    here memory://, whose fallback re-reads the manifest before the PUT). Host, pid, time and uuids vary: masked."""
    import re
    import uuid

    from fsdp_plugin.checkpoint.storage import _publish_remote

    path, real = f"memory://b{uuid.uuid4().hex[:12]}/run/step100", _publish_remote.publish
    fp.save_checkpoint(path, fp.shard(nn.Linear(2, 2)), extra={"step": 100})

    def other_job_first(tmp, p, data, base):
        _publish_remote.publish = real
        fp.save_checkpoint(path, fp.shard(nn.Linear(2, 2)), extra={"step": 100})
        return real(tmp, p, data, base)

    _publish_remote.publish = other_job_first
    try:
        fp.save_checkpoint(path, fp.shard(nn.Linear(2, 2)), extra={"step": 100})
    except fp.CheckpointError as e:
        msg = re.sub(r"[0-9a-f]{32}", "<uuid>", str(e).replace(path, "s3://bucket/run/step100"))
        msg = re.sub(r"host \S+ pid \d+, at [0-9-]+ [0-9:]+ UTC", "host <host> pid <pid>, at <time> UTC", msg)
        raise fp.CheckpointError(msg) from None
    finally:
        _publish_remote.publish = real


def _late_rank(rank, world, trace_dir):
    import re
    import time
    os.environ["FSDP_PLUGIN_TRACE_DIR"] = trace_dir
    model = fp.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), auto_wrap_policy={nn.Linear}, timeout_s=3)
    for step in range(3):
        if rank == 2 and step == 2:
            time.sleep(6)      # stuck in its data loader
            os._exit(0)
        try:
            model(torch.ones(2, 4)).sum().backward()
        except fp.CollectiveError as e:
            text = re.sub(r"\d+\.\ds ago", "<t>s ago", str(e))
            # a loaded machine can starve rank 2's status thread for a few periods: the other wording, same error
            text = re.sub(r"; its status stopped updating \d+s ago: the process is dead or frozen \(holding the GIL\)",
                          " (its status of <t>s ago)", text)
            text = re.sub(r"\.py:\d+ in", ".py:<line> in", text)
            return re.sub(r"host \S+, pid \d+", "host <host>, pid <pid>", text)


def collective_deadline_names_the_late_rank(tmp_path):
    """3 ranks, rank 2 stalls before its third step: ranks 0 and 1 name it (ages, host and pid normalized)."""
    raise fp.CollectiveError(run_ranks(_late_rank, 3, str(tmp_path), timeout=60, may_die={2})[0])


def join_before_any_batch():
    """torch's Join calls this when a rank had no batch at all inside the context."""
    fp.shard(nn.Sequential(nn.Linear(2, 2)))._fp_root.join.shadow_step()


def activation_checkpointing_every_zero():
    fp.ShardingConfig(activation_checkpointing=fp.Checkpointing(modules={Block}, every=0))


def activation_checkpointing_without_units():
    fp.shard(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), auto_wrap_policy=lambda m: False,
             activation_checkpointing=True)


def _ranks_error(fn, world=2):
    """Run ``fn`` on ``world`` ranks and re-raise the OptimizerError it raised on rank 0."""
    try:
        run_ranks(fn, world)
    except RankFailure as e:
        line = [ln for ln in str(e).splitlines() if ln.startswith("fsdp_plugin.errors.OptimizerError: ")][0]
        raise fp.OptimizerError(line.split("OptimizerError: ", 1)[1]) from None


def _stepped_early(rank, world):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    fp.shard(model)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()


def optimizer_stepped_before_shard():
    """On 2 ranks: with one rank the sharded parameters keep their full shape and the old state still fits."""
    _ranks_error(_stepped_early)


def _matrices():
    torch.manual_seed(0)
    return fp.shard(nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 5)))   # on 2 ranks the first weight is cut 6 | 1 rows


class Muon(torch.optim.SGD):
    """Stands for a third-party Muon (by name; torch.optim.Muon itself runs the owner step)."""


def _stock_muon(rank, world):
    model = _matrices()
    opt = Muon([p for p in model.parameters() if p.ndim == 2], lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()


def third_party_muon_on_a_split_matrix():
    _ranks_error(_stock_muon)


class LAMB(torch.optim.SGD):
    """Stands for a third-party per-tensor optimizer (refused by name; Adafactor runs the owner step)."""


def _adafactor(rank, world):
    model = _matrices()
    opt = LAMB(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    opt.step()


def per_tensor_optimizer_on_shard_pieces():
    _ranks_error(_adafactor)


def muon_given_a_vector():
    fp.optim.Muon(_matrices().parameters())


def muon_with_adamw_group_without_use_muon():
    fp.optim.MuonWithAdamW([{"params": list(_matrices().parameters()), "lr": 0.02}])


def _muon_unsharded(rank, world):
    model = nn.Linear(8, 6, bias=False)
    opt = fp.optim.Muon(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()


def muon_on_a_model_never_sharded():
    _ranks_error(_muon_unsharded)


CASES = [unknown_strategy, unknown_option, bad_reshard_after_forward, hpz_size_not_dividing_the_shard_group,
         hpz_size_below_one, plan_nodes_not_dividing_the_world, unknown_pairing_check, wrap_policy_matches_nothing,
         bad_fp32_modules_value, fp32_modules_match_nothing, fp32_modules_without_16_bit_compute,
         fp32_module_tied_to_a_16_bit_module,
         mesh_not_dividing_world, shard_twice, optimizer_stepped_before_shard, dtype_backend_cannot_reduce,
         plain_state_dict_on_sharded_model, not_sharded, meta_module_without_init,
         transformers_init_leaves_module_unset, skip_cannot_fill_nonpersistent_buffer,
         nonfinite_gradients_with_clipping, checkpoint_from_another_architecture,
         lightning_fsdp_option_without_equivalent, lightning_torch_checkpoint_not_ours,
         trainer_resume_from_foreign_folder, compile_unsharded_model, unknown_async_save_mode,
         plan_of_an_unknown_model, materialize_a_tensor_that_is_not_deferred, checkpoint_extra_that_needs_pickle,
         dcp_metadata_naming_a_foreign_global, truncated_dcp_data_file, dcp_save_interrupted,
         dcp_optimizer_groups_differ, export_dcp_onto_an_existing_directory,
         load_a_directory_that_is_not_a_checkpoint, load_an_interrupted_save,
         activation_checkpointing_every_zero, activation_checkpointing_without_units,
         collective_deadline_names_the_late_rank, join_before_any_batch,
         third_party_muon_on_a_split_matrix, per_tensor_optimizer_on_shard_pieces, muon_given_a_vector,
         muon_with_adamw_group_without_use_muon,
         muon_on_a_model_never_sharded, a_unit_runs_on_some_ranks_only, some_ranks_modules_matches_nothing,
         tensor_parallel_partial_parameter, tensor_parallel_over_two_mesh_dims,
         tensor_parallel_without_data_parallel_mesh, tensor_parallel_mesh_of_another_root,
         tensor_parallel_model_wrapped_by_fsdp2, per_tensor_optimizer_on_tensor_parallel_boxes,
         device_mesh_smaller_than_world_without_tensor_parallelism, lightning_fabric_with_tensor_parallel_size,
         lightning_parallel_sizes_not_matching_the_world, lightning_tensor_parallel_without_configure_model,
         lightning_configure_model_parallelized_nothing, lightning_uneven_batches_with_tensor_parallelism,
         plan_of_a_tensor_parallel_model, accelerate_tensor_parallel_without_dp_shard,
         accelerate_tensor_parallel_model_without_plan, accelerate_optimizer_stepped_before_tensor_parallel_prepare,
         stream_with_unknown_names, stream_consumer_fails_on_rank_0, stream_merge_of_a_dora_adapter,
         trl_vllm_sync_on_an_unknown_trl_version,
         unknown_quantization_format, quantization_block_size_not_a_multiple_of_8, quantized_weights_under_no_shard]
CASES += [checkpoint_url_without_filesystem, export_dcp_to_a_url_holding_objects]  # issue 33: URLs
CASES += [checkpoint_replaced_by_another_save_while_uploading]  # issue 33: replace conditional on the manifest read
CASES += [default_tower_fed_under_an_unknown_input_name,  # issue 32b: the on-demand tower, fp.plan of a VLM
          plan_of_a_forward_that_reads_integers_from_its_inputs]
CASES += [plan_tp_size_not_dividing_the_world, plan_tp_plan_with_an_unknown_style]  # issue 31: 2-D plans


def context_parallel_of_a_module_holding_no_transformers_model():
    fp.shard(GPT(), context_parallel=2)


def context_parallel_of_a_linear_attention_model():
    import transformers as tf
    cfg = tf.Qwen3NextConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with torch.device("meta"):
        model = tf.Qwen3NextForCausalLM(cfg)
    fp.shard(model, context_parallel=2)


def plan_context_parallel_of_a_module_holding_no_transformers_model():
    fp.plan(GPT, world_size=2, context_parallel=2)


def plan_expert_parallel_not_dividing_the_experts():
    import transformers as tf
    cfg = tf.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2)
    fp.plan(lambda: tf.Qwen3MoeForCausalLM(cfg), world_size=3, expert_parallel=3)


CASES += [context_parallel_of_a_module_holding_no_transformers_model,  # issue 54: context parallel
          context_parallel_of_a_linear_attention_model, plan_context_parallel_of_a_module_holding_no_transformers_model,
          plan_expert_parallel_not_dividing_the_experts,
          context_parallel_with_a_device_mesh_without_its_cp_dimension]   # issue 54: CP x TP recipe
CASES += [expert_parallel_with_the_experts_in_the_tp_plan]   # issue 55: EP x TP, experts whole on every TP rank


def _capture(case, tmp_path):
    try:
        case(tmp_path) if case.__code__.co_argcount else case()
    except Exception as e:  # noqa: BLE001 - the catalog records whatever each case raises
        return _class_line(type(e)), str(e).strip().replace(str(tmp_path), "<dir>")
    raise AssertionError(f"{case.__name__} raised nothing")


def _class_line(cls) -> str:
    """``Name`` (its bases): the class to catch, and the builtin it also is."""
    return f"`{cls.__name__}` ({', '.join(b.__name__ for b in cls.__bases__)})"


def error_classes() -> list:
    """Every exception class defined anywhere in the package (engine, checkpoints, integrations)."""
    import importlib
    import pkgutil

    import fsdp_plugin.integrations as integrations

    found = []
    # fsdp_plugin.integrations is installed from ../integrations (package-dir), outside fp.__path__: walk both
    infos = [*pkgutil.walk_packages(fp.__path__, "fsdp_plugin."),
             *pkgutil.walk_packages(integrations.__path__, "fsdp_plugin.integrations.")]
    for info in sorted(infos, key=lambda i: i.name):
        if info.name.endswith(("__main__", ".cli")):
            continue
        mod = importlib.import_module(info.name)
        found += [v for v in vars(mod).values() if isinstance(v, type) and issubclass(v, Exception)
                  and not issubclass(v, Warning) and v.__module__ == mod.__name__ and v not in found]
    order = {"fsdp_plugin.errors": 0, "fsdp_plugin.checkpoint.errors": 1}
    return sorted(found, key=lambda c: order.get(c.__module__, 2))


def _render(rows):
    out = ["# Errors and what to do about them",
           "",
           "Generated by `tests/test_error_catalog.py` from the situations below (the test fails if this file",
           "drifts from the code). Every message names the fix. Every class derives from `FSDPPluginError`",
           "(`except fp.FSDPPluginError` catches everything the package raises) and keeps a builtin base.",
           "",
           "## Classes",
           ""]
    out += [f"- {_class_line(c)}: {(c.__doc__ or '').strip().splitlines()[0]}" for c in error_classes()]
    out.append("")
    for name, (exc, msg) in rows:
        out += [f"## {name.replace('_', ' ')}", "", exc, "", "```", msg, "```", ""]
    return "\n".join(out)


def test_every_error_class_derives_from_the_base():
    classes = error_classes()
    assert len(classes) > 15
    for cls in classes:
        assert issubclass(cls, fp.FSDPPluginError), f"{cls.__module__}.{cls.__name__} does not derive from FSDPPluginError"


def test_error_catalog_matches_docs(tmp_path):
    rows = []
    for case in CASES:
        d = tmp_path / case.__name__
        d.mkdir()
        rows.append((case.__name__, _capture(case, d)))
    for name, (exc, msg) in rows:
        assert "AssertionError" not in exc and len(msg) > 40, (name, exc, msg)
    text = _render(rows)
    if os.environ.get("FSDP_PLUGIN_WRITE_ERROR_DOCS"):
        with open(DOC, "w") as f:
            f.write(text)
    with open(DOC) as f:
        assert f.read() == text, "docs/errors.md is stale: regenerate it (see this module's docstring)"
