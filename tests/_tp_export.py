"""Tensor-parallel exports (issue 31): HF safetensors written from a 2 dp x 2 tp model without a gather to one
rank, and the workers of the DCP round trips with torch's FSDP2 + TP."""
from __future__ import annotations

import torch
import torch.distributed as dist

import fsdp_plugin as fp
import _tp


def _count_sends():
    """Count point-to-point sends of the checkpoint code (the no-shared-filesystem fallback's only traffic)."""
    from fsdp_plugin.checkpoint import _comm
    sent, real = [], _comm.send
    _comm.send = lambda *a, **k: sent.append(1) or real(*a, **k)
    return sent


def _trained_llama():
    """The tiny Llama on its own tp_plan at 2 x 2, one AdamW step taken (values unlike any initialization)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_hf(_tp.llama(), mesh["tp"])
    fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={LlamaDecoderLayer})
    opt = _tp.make_optimizer("adamw", model.parameters())
    idx = _tp.llama_batch(0, dist.get_rank() // 2)
    model(input_ids=idx, labels=idx).loss.backward()
    opt.step()
    return model


def save_pretrained_worker(rank, world, out: str):
    """fp.save_pretrained (every rank its boxes; gather=True; split files), model.save_pretrained (the library's
    plan, ranged writes; and with the last rank not seeing the files); returns (full state, sends per save,
    whether a save fell back to the rank-0 gather)."""
    import fsdp_plugin.integrations.transformers as integration
    from fsdp_plugin.integrations import _ranged_save
    from fsdp_plugin.checkpoint.hf import ranged
    integration.install()
    model = _trained_llama()
    full = fp.full_state_dict(model, rank0_only=False)
    gathered, real = [], _ranged_save.write_on_rank0
    _ranged_save.write_on_rank0 = lambda *a: gathered.append(1) or real(*a)
    sent = _count_sends()
    sends = {}
    for name, save in [("fp", lambda d: fp.save_pretrained(model, d, max_shard_size="8KB")),
                       ("fp_gather", lambda d: fp.save_pretrained(model, d, gather=True)),
                       ("hf", lambda d: model.save_pretrained(d, max_shard_size="8KB"))]:
        before = len(sent)
        save(f"{out}/{name}")
        sends[name] = len(sent) - before
    if rank == world - 1:
        ranged._sees = lambda files: False   # as if this rank did not see rank 0's files: pieces go to rank 0
    before = len(sent)
    model.save_pretrained(f"{out}/hf_p2p")
    sends["hf_p2p"] = len(sent) - before
    return full, sends, bool(gathered)


def toy_save_worker(rank, world, out: str, dp_shape: tuple):
    """The toy GPT (uneven 9 | 8 MLP split, rowwise boxes cut into dp rows, a SequenceParallel norm) saved by
    fp.save_pretrained at dp_shape x 2 after one step; returns its full state."""
    model, _ = _tp.build_2d(dp_shape, 2, sharding_strategy="hybrid_shard" if len(dp_shape) == 2 else "full_shard")
    opt = _tp.make_optimizer("adamw", model.parameters())
    model(*_tp.batch(0, rank // 2)).backward()
    opt.step()
    fp.save_pretrained(model, out, max_shard_size="4KB")
    return fp.full_state_dict(model, rank0_only=False)
