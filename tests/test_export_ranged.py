"""Exports without a gather: transformers' ``save_pretrained`` / PEFT adapter saves on a sharded model write
every rank's own byte ranges (``integrations/_ranged_save.py``), and the files are byte-identical to the
library's own save of an unsharded copy with the same weights: safetensors shards, index, configs.
``st_header`` reproduces the safetensors library's header and layout exactly."""
from __future__ import annotations

import os
import struct

import pytest
import torch
from _dist import run_ranks

import fsdp_plugin as fp
from fsdp_plugin.checkpoint.format import st_header
from fsdp_plugin.checkpoint.format._format import dtype_name

pytest.importorskip("transformers")


def _header(path) -> bytes:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n)


@pytest.mark.parametrize("metadata", [None, {}, {"format": "pt"}, {"format": "pt", "zz": "1", "aa": "2"}])
def test_header_is_the_safetensors_library_layout(tmp_path, metadata):
    from safetensors.torch import _TYPES, save_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}.{'é' if i % 5 == 0 else 'w'}": torch.randint(0, 2, (i % 3 + 1, i % 4), generator=g).to(dt)
               for i, dt in enumerate(_TYPES.values())}
    tensors["empty"] = torch.zeros(0, 3)
    path = tmp_path / "ref.safetensors"
    save_file(tensors, path, metadata=metadata)
    entries = [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]
    header, offsets, size = st_header.encode(entries, metadata)
    raw = path.read_bytes()
    if metadata and len(metadata) > 1:  # the library orders metadata keys by a seeded hash: only the set is fixed
        import json

        assert json.loads(header[8:]) == json.loads(raw[8:len(header)]) and size == len(raw)
        header = raw[:len(header)]
    assert header == raw[:len(header)] and size == len(raw)
    rebuilt = bytearray(size)
    rebuilt[:len(header)] = header
    for n, t in tensors.items():
        data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        rebuilt[offsets[n]:offsets[n] + len(data)] = data
    assert bytes(rebuilt) == raw


def _llama(seed: int, tie: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                            init_lora_weights=False))
    return peft


def _build(tie: bool, adapter: bool):
    model = _llama(3, tie)
    return _lora(model) if adapter else model


def _ranks(rank, world, out, tie, adapter, shared=True):
    import fsdp_plugin.integrations.transformers as integration
    from fsdp_plugin.integrations import _ranged_save

    from fsdp_plugin.checkpoint.hf import ranged

    integration.install()
    if not shared and rank == world - 1:
        ranged._sees = lambda files: False  # as if this rank did not see rank 0's files: pieces go point-to-point
    model = _build(tie, adapter)
    fp.shard(model)
    gathered = []
    real = _ranged_save.write_on_rank0
    _ranged_save.write_on_rank0 = lambda *a: gathered.append(1) or real(*a)
    model.save_pretrained(out, max_shard_size="12KB")
    return bool(gathered)


def _files(d) -> dict[str, bytes]:
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


@pytest.mark.parametrize("world,tie,adapter,shared", [(2, True, False, True), (3, False, False, True),
                                                      (3, True, False, False), (2, False, True, True)])
def test_save_pretrained_sharded_is_byte_identical_to_transformers(tmp_path, world, tie, adapter, shared):
    ref, out = tmp_path / "ref", tmp_path / "out"
    _build(tie, adapter).save_pretrained(ref, max_shard_size="12KB")
    gathered = run_ranks(_ranks, world, str(out), tie, adapter, shared, timeout=180)
    assert not any(gathered)  # the ranged path, not the rank-0 fallback
    want, got = _files(ref), _files(out)
    if not adapter:
        assert "model.safetensors.index.json" in want and sum(n.endswith(".safetensors") for n in want) > 2
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


def _acc_model():
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 24)
    model = torch.nn.Sequential(torch.nn.Embedding(40, 24), lin, torch.nn.LayerNorm(24), torch.nn.Linear(24, 40))
    model[3].weight = model[0].weight  # tied: written once, under accelerate's choice of name
    model.register_buffer("steps", torch.arange(5))
    return model


def _acc_ranks(rank, world, out):
    os.environ.update({"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
                       "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true", "MASTER_ADDR": "localhost",
                       "MASTER_PORT": "0", "ACCELERATE_MIXED_PRECISION": "no"})
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations import _ranged_save
    from fsdp_plugin.integrations.accelerate import Accelerator

    acc = Accelerator()
    model = acc.prepare(_acc_model())
    assert fp.is_sharded(acc.unwrap_model(model))
    gathered = []
    real = _ranged_save.write_on_rank0
    _ranged_save.write_on_rank0 = lambda *a: gathered.append(1) or real(*a)
    acc.save_model(model, out, max_shard_size="2KB")
    return bool(gathered)


def test_accelerate_save_model_is_byte_identical_to_stock(tmp_path):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator as Stock
    from accelerate.state import AcceleratorState, GradientState

    ref, out = tmp_path / "ref", tmp_path / "out"
    try:
        Stock(cpu=True).save_model(_acc_model(), ref, max_shard_size="2KB")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert not any(run_ranks(_acc_ranks, 2, str(out), timeout=180))
    want, got = _files(ref), _files(out)
    assert "model.safetensors.index.json" in want and sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


class _TrainerStub:
    """What ``Trainer._save`` and our ``save_model`` replacement read from a Trainer (no training loop needed)."""

    processing_class = data_collator = None
    is_distributed_loading_by_transformers = False

    def __init__(self, model, out, active):
        from types import SimpleNamespace

        self.model = model
        self.args = SimpleNamespace(should_save=True, output_dir=out, push_to_hub=False, save_only_model=False)
        self.accelerator = SimpleNamespace(_fp_active=active, fsdp_settings=None, unwrap_model=lambda m, **_: m)

    def _save(self, output_dir=None, state_dict=None):
        from transformers import Trainer

        return Trainer._save(self, output_dir, state_dict)


def _trainer_ranks(rank, world, out):
    import fsdp_plugin.integrations.transformers as integration
    from fsdp_plugin.integrations import _ranged_save
    from fsdp_plugin.integrations.transformers import _trainer

    integration.install()
    model = _build(True, False)
    fp.shard(model)
    gathered = []
    real = _ranged_save.write_on_rank0
    _ranged_save.write_on_rank0 = lambda *a: gathered.append(1) or real(*a)
    _trainer.save_model(None, _TrainerStub(model, out, True), out)
    return bool(gathered)


def test_trainer_save_model_is_byte_identical_to_the_trainers_own(tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    _TrainerStub(_build(True, False), str(ref), False)._save(str(ref))
    assert not any(run_ranks(_trainer_ranks, 2, str(out), timeout=180))
    want, got = _files(ref), _files(out)
    assert {"model.safetensors", "config.json", "training_args.bin"} <= set(want) and sorted(got) == sorted(want)
    for name in set(want) - {"training_args.bin"}:  # torch.save of the arguments: their path, a random id
        assert got[name] == want[name], name


def _gpt():
    from models import GPT

    torch.manual_seed(0)
    return GPT(vocab=64, d=16, n_layer=2, seq=16)


_LIGHTNING = {"epoch": 3, "global_step": 12, "hyper_parameters": {"lr": 0.1, "name": "x"}}


def _lightning_ranks(rank, world, out):
    from fsdp_plugin.integrations.lightning.checkpoint import torch_file
    from models import Block

    model = _gpt()
    fp.shard(model, auto_wrap_policy={Block})
    torch_file.write_sharded(__import__("pathlib").Path(out), model, dict(_LIGHTNING), {"extra": [1, 2]})
    return os.path.exists(out)


def _records(path) -> dict[str, bytes]:
    import zipfile

    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None  # every CRC32 right
        return {i.filename.split("/", 1)[1]: zf.read(i) for i in zf.infolist()}


def test_lightning_full_file_written_by_ranges_matches_the_gathered_one(tmp_path):
    from pathlib import Path

    from fsdp_plugin.integrations.lightning.checkpoint import torch_file

    ref, out = tmp_path / "ref.ckpt", tmp_path / "out.ckpt"
    torch_file.write(ref, _gpt().state_dict(), dict(_LIGHTNING), {"extra": [1, 2]})
    assert all(run_ranks(_lightning_ranks, 2, str(out), timeout=180))
    want, got = _records(ref), _records(out)
    assert sorted(got) == sorted(want)
    for name in set(want) - {"data.pkl", ".data/serialization_id"}:  # the id is torch's, random per save
        assert got[name] == want[name], name
    a, b = torch.load(ref, weights_only=True), torch.load(out, weights_only=True)  # the same payload
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in _LIGHTNING)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    (sa, ea), (sb, eb) = torch_file.read(ref), torch_file.read(Path(out))  # and our pickle-free reader
    assert ea == eb and all(torch.equal(sa[k], sb[k]) for k in sa) and sa.keys() == sb.keys()


def _lightning_ckpt_ranks(rank, world, path):
    from fsdp_plugin.integrations.lightning.checkpoint import io as lio
    from models import Block

    model = _gpt()
    fp.shard(model, auto_wrap_policy={Block})
    lio.save_sharded(__import__("pathlib").Path(path), model, [], lio.encode_meta(dict(_LIGHTNING)))


def test_consolidate_lightning_streams_the_same_records(tmp_path):
    from fsdp_plugin.integrations.lightning.checkpoint import io as lio
    from fsdp_plugin.integrations.lightning.checkpoint import torch_file

    from fsdp_plugin.checkpoint.consolidate import state_entries
    from fsdp_plugin.cli import main

    ck, out, ref = tmp_path / "ck", tmp_path / "out.ckpt", tmp_path / "ref.ckpt"
    run_ranks(_lightning_ckpt_ranks, 2, str(ck), timeout=180)
    assert main(["consolidate", str(ck), str(out), "--format", "lightning", "-q"]) == 0
    plain = _gpt().state_dict()
    tree, tensors = lio.encode_meta(dict(_LIGHTNING))
    torch_file.write(ref, {n: plain[n] for n, _, _ in state_entries(ck)}, lio.decode_state(tree, tensors),
                     {lio.FULL_META_KEY: lio.inline_tensors(tree, tensors)})
    want, got = _records(ref), _records(out)
    assert sorted(got) == sorted(want)
    for name in set(want) - {"data.pkl", ".data/serialization_id"}:
        assert got[name] == want[name], name
    a, b = torch.load(ref, weights_only=True), torch.load(out, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in plain)


def _consolidate_lightning_rss(ck, out, q):
    import resource

    from fsdp_plugin.integrations.lightning.checkpoint.convert import (
        consolidate_lightning,
    )

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    consolidate_lightning(ck, out)
    q.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)


@pytest.mark.slow
def test_consolidate_lightning_memory_is_bounded(tmp_path):
    """``consolidate --format lightning`` of 2 x 128 MB tensors raises peak RSS by < 64 MB (it used to hold both)."""
    import multiprocessing as mp
    from pathlib import Path

    from fsdp_plugin.integrations.lightning.checkpoint import io as lio

    model = torch.nn.Sequential(torch.nn.Linear(4096, 8192, bias=False), torch.nn.Linear(8192, 4096, bias=False))
    lio.save_sharded(Path(tmp_path / "ck"), model, [], lio.encode_meta(dict(_LIGHTNING)))
    del model
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_consolidate_lightning_rss,
                                        args=(str(tmp_path / "ck"), str(tmp_path / "m.ckpt"), q))
    p.start()
    delta_kb = q.get(timeout=300)
    p.join()
    assert delta_kb < 64 * 1024, f"peak RSS grew by {delta_kb / 1024:.0f} MB"
    assert torch.load(tmp_path / "m.ckpt", weights_only=True)["state_dict"]["1.weight"].shape == (4096, 8192)


def _pickled_adapter_ranks(rank, world, out):
    import fsdp_plugin.integrations.transformers as integration
    from fsdp_plugin.integrations import _ranged_save

    integration.install()
    model = _build(False, True)
    fp.shard(model)
    gathered = []
    real = _ranged_save.write_on_rank0
    _ranged_save.write_on_rank0 = lambda *a: gathered.append(1) or real(*a)
    model.save_pretrained(out, safe_serialization=False)
    return bool(gathered)


def test_pickled_adapter_save_falls_back_to_the_gather(tmp_path):
    """PEFT's ``safe_serialization=False`` pickles the weights: stand-ins must never reach that file."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    _build(False, True).save_pretrained(ref, safe_serialization=False)
    assert all(run_ranks(_pickled_adapter_ranks, 2, str(out), timeout=180)[:1])
    a = torch.load(ref / "adapter_model.bin", weights_only=True)
    b = torch.load(out / "adapter_model.bin", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            num_local_experts=4, num_experts_per_tok=2))


def _moe_ranks(rank, world, out):
    import fsdp_plugin.integrations.transformers as integration
    from fsdp_plugin.integrations import _ranged_save

    integration.install()
    model = _mixtral()
    fp.shard(model)
    gathered = []
    real = _ranged_save.write_on_rank0
    _ranged_save.write_on_rank0 = lambda *a: gathered.append(1) or real(*a)
    model.save_pretrained(out, max_shard_size="40KB")
    return bool(gathered)


def test_moe_save_pretrained_reverts_fused_experts_and_is_byte_identical(tmp_path):
    """Mixtral's fused ``experts.gate_up_proj`` is written back per expert by transformers' reverse conversion
    (a chunk, a copy, an unbind): the copies are planned from the fused layout (``hf.fused_runs``), so the save
    still writes by ranges, and the files are transformers' own."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    _mixtral().save_pretrained(ref, max_shard_size="40KB")
    gathered = run_ranks(_moe_ranks, 2, str(out), timeout=180)
    want, got = _files(ref), _files(out)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name
    assert not any(gathered), "the fused experts were gathered"
