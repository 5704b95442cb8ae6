"""TRL's vLLM weight sync on our engine, on CPU without vLLM.

Two trainer ranks train a policy sharded by fp.shard (next to a frozen reference model, also sharded) and
call TRL's own ``VLLMGeneration.sync_weights`` (GRPO, RLOO) or online DPO's ``_move_model_to_vllm_inner``,
with the one-line integration imported. Server mode: a receiver process, joined to trainer rank 0 only by its
own gloo group, stands in for the vLLM server: it gets the metadata first, then packed uint8 buckets (TRL's
``update_named_params`` protocol), unpacks every tensor and saves them; the test compares them bit-exactly
with ``fp.full_state_dict`` after the step (HF names: tied head once; LoRA merged as PEFT's
``merge_and_unload`` would). Colocate mode: every rank's ``load_weights`` collects what it gets.
"""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import transformers as tf
from _dist import run_ranks
from safetensors.torch import load_file, save_file

import fsdp_plugin as fp

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

_CFG = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def _llama(seed=0):
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**_CFG, tie_word_embeddings=True))


def _lora(model):
    import peft
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))


# -- the stand-in for vLLM: its own gloo group with trainer rank 0 -----------------------------------------------
def _side_group(path: str, rank: int):
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=60)
    return dist.ProcessGroupGloo(dist.FileStore(path, 2), rank, 2, opts)


def _send_int(pg, n: int) -> None:
    pg.broadcast(torch.tensor([n], dtype=torch.int64), 0).wait()


def _recv_int(pg) -> int:
    t = torch.zeros(1, dtype=torch.int64)
    pg.broadcast(t, 0).wait()
    return int(t.item())


class FakeVLLMClient:
    """TRL's ``VLLMClient`` weight calls: metadata announced first, then tensors packed into uint8 buckets."""

    def __init__(self, pg, bucket_bytes: int = 4096):
        self.pg, self.bucket_bytes = pg, bucket_bytes

    def update_named_params(self, metadata, named_params) -> None:
        doc = json.dumps(metadata).encode()
        _send_int(self.pg, len(doc))
        self.pg.broadcast(torch.frombuffer(bytearray(doc), dtype=torch.uint8), 0).wait()
        bucket, size = [], 0
        for i, (name, t) in enumerate(named_params):
            assert (name, str(t.dtype).removeprefix("torch."), list(t.shape)) == tuple(metadata[i]), name
            b = t.detach().contiguous().view(-1).view(torch.uint8).clone()
            if bucket and size + b.numel() > self.bucket_bytes:
                self._flush(bucket)
                bucket, size = [], 0
            bucket.append(b)
            size += b.numel()
        if bucket:
            self._flush(bucket)
        _send_int(self.pg, 0)

    def _flush(self, bucket) -> None:
        packed = torch.cat(bucket)
        _send_int(self.pg, packed.numel())
        self.pg.broadcast(packed, 0).wait()

    def update_named_param(self, name, weights) -> None:
        self.update_named_params([(name, str(weights.dtype).removeprefix("torch."), list(weights.shape))],
                                 iter([(name, weights)]))

    def reset_prefix_cache(self) -> None:
        pass

    def close(self) -> None:
        _send_int(self.pg, -1)


def _receiver(path: str, out: str) -> None:
    pg, got = _side_group(path, 1), {}
    while (n := _recv_int(pg)) >= 0:
        doc = torch.zeros(n, dtype=torch.uint8)
        pg.broadcast(doc, 0).wait()
        meta, i = json.loads(bytes(doc.tolist())), 0
        while (size := _recv_int(pg)) > 0:
            buf = torch.zeros(size, dtype=torch.uint8)
            pg.broadcast(buf, 0).wait()
            off = 0
            while off < size:
                name, dtype, shape = meta[i]
                dt = getattr(torch, dtype)
                nbytes = torch.Size(shape).numel() * dt.itemsize
                got[name] = buf[off:off + nbytes].view(dt).view(shape).clone()
                off, i = off + nbytes, i + 1
    save_file(got, out)


class _Colocated:
    """``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights`` of a colocated engine."""

    def __init__(self):
        self.got = {}
        model = SimpleNamespace(load_weights=lambda pairs: self.got.update({n: t.clone() for n, t in pairs}))
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model))))

    def reset_prefix_cache(self):
        pass


# -- the trainer ranks -------------------------------------------------------------------------------------------
def _step(model, rank):
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, _CFG["vocab_size"], (2, 8), generator=g)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _sync(trainer_kind, policy, mode, client, llm):
    if trainer_kind == "grpo":
        from trl.generation.vllm_generation import VLLMGeneration
        gen = VLLMGeneration.__new__(VLLMGeneration)      # no vLLM: only what sync_weights reads
        gen.model, gen.mode, gen.enable_sleep_mode, gen._weight_metadata = policy, mode, False, None
        gen.accelerator = SimpleNamespace(is_main_process=dist.get_rank() == 0)
        gen.vllm_client, gen.llm = client, llm
        gen.sync_weights()
    elif trainer_kind == "online_dpo":
        from trl.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer
        trainer = OnlineDPOTrainer.__new__(OnlineDPOTrainer)
        trainer.model, trainer.vllm_mode, trainer.vllm_client, trainer.llm = policy, mode, client, llm
        trainer._move_model_to_vllm_inner()
    else:  # adapter-only, the same protocol fed by the iterator itself
        meta = [(n, str(d).removeprefix("torch."), list(s)) for n, s, d in fp.full_params_meta(policy)]
        stream = fp.iter_full_params(policy)
        if client is not None:
            client.update_named_params(meta, stream)
        else:
            for _ in stream:
                pass


def _trainer(rank, world, tmp, trainer_kind, mode, lora):
    import trl.experimental.online_dpo.online_dpo_trainer  # noqa: F401 - TRL imported first, as a script does
    import trl.generation.vllm_generation as vg

    import fsdp_plugin.integrations.transformers as integration

    integration.install()   # what the one-line import does in a fresh process (here it may be imported already)

    assert getattr(vg.VLLMGeneration._iter_named_params, "__fsdp_plugin__", False)
    proc = None
    if mode == "server" and rank == 0:
        proc = mp.get_context("fork").Process(target=_receiver, args=(f"{tmp}/side", f"{tmp}/got.safetensors"))
        proc.start()
    client = FakeVLLMClient(_side_group(f"{tmp}/side", 0)) if mode == "server" and rank == 0 else None
    llm = _Colocated() if mode == "colocate" else None
    policy = fp.shard(_lora(_llama()) if lora else _llama())
    ref = fp.shard(_llama(seed=7).requires_grad_(False).eval())       # a frozen reference model alongside
    _step(policy, rank)
    with torch.no_grad():
        ref(input_ids=torch.zeros(1, 4, dtype=torch.long))
    _sync(trainer_kind, policy, mode, client, llm)
    _sync(trainer_kind, policy, mode, client, llm)  # every step syncs: the second walk must be the same
    if client is not None:
        client.close()
        proc.join(timeout=60)
        assert proc.exitcode == 0
    full = fp.full_state_dict(policy, rank0_only=False)
    if rank == 0:
        save_file({k: v.clone() for k, v in full.items()}, f"{tmp}/full.safetensors")
    return {k: v for k, v in llm.got.items()} if llm is not None else None


def _expected(tmp, lora):
    """What vLLM must receive: the trained policy under checkpoint names (LoRA: PEFT's merge), from the full state."""
    full = load_file(f"{tmp}/full.safetensors")
    if lora == "adapters":
        from peft.utils import get_peft_model_state_dict
        model = _lora(_llama())
        model.load_state_dict(full)
        return get_peft_model_state_dict(model)
    model = _lora(_llama()) if lora else _llama()
    model.load_state_dict(full)
    if lora:
        model = model.merge_and_unload()
    sd = model.state_dict()
    sd.pop("lm_head.weight")            # tied: vLLM loads it once, as the HF checkpoint stores it
    return sd


def _compare(got: dict, want: dict) -> None:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("trainer_kind,mode,lora", [
    ("grpo", "server", False), ("grpo", "server", True), ("grpo", "colocate", False), ("grpo", "colocate", True),
    ("online_dpo", "server", False), ("online_dpo", "colocate", True), ("adapters", "server", "adapters")])
def test_trl_sync_streams_full_weights(tmp_path, trainer_kind, mode, lora):
    tmp = str(tmp_path)
    out = run_ranks(_trainer, 2, tmp, trainer_kind, mode, bool(lora), timeout=120)
    want = _expected(tmp, lora)
    if mode == "server":
        _compare(load_file(f"{tmp}/got.safetensors"), want)
    else:
        for got in out:
            _compare(got, want)


def _unknown(rank, world):
    import trl
    from fsdp_plugin.integrations.transformers import _trl

    trl.__version__ = "0.0.1"
    fake = type("GRPOTrainer", (), {"__module__": "trl.trainer.grpo_trainer"})()
    fake.args = SimpleNamespace(use_vllm=True)        # GRPOConfig(use_vllm=True)
    try:
        _trl.prepare(fake)
    except fp.UnsupportedError as e:
        return str(e)
    return "accepted"


def test_an_unknown_trl_version_is_refused_by_name():
    msg = run_ranks(_unknown, 1)[0]
    assert msg.startswith("TRL 0.0.1 with use_vllm=True on fsdp_plugin") and "trl==1.16.0" in msg, msg
