"""Tensor-parallel exports (issue 31): HF safetensors written from a 2 dp x 2 tp model without a gather to one
rank, and the workers of the DCP round trips with torch's FSDP2 + TP."""
from __future__ import annotations

import contextlib

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
                       ("fp_gather", lambda d: fp.save_pretrained(model, d, max_shard_size="8KB", gather=True)),
                       ("hf", lambda d: model.save_pretrained(d, max_shard_size="8KB"))]:
        before = len(sent)
        save(f"{out}/{name}")
        sends[name] = len(sent) - before
    if rank == world - 1:
        ranged._sees = lambda files: False   # as if this rank did not see rank 0's files: pieces go to rank 0
    before = len(sent)
    model.save_pretrained(f"{out}/hf_p2p", max_shard_size="8KB")
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


# ------------------------------------------------------------------ DCP with torch's FSDP2 + the same TP plan
def fsdp2_tp():
    """The toy GPT on torch's own 2-D recipe: parallelize_module on mesh['tp'], fully_shard over mesh['dp']."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard          # the baseline: tests may import FSDP2, the engine never
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = _tp.TPGPT()
    parallelize_module(model, mesh["tp"], _tp.tp_plan())
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def _train(model, opt, steps, first: int = 0) -> list:
    """Global mean loss per step; the data of _tp.batch for rank // 2 (the dp rank at tp 2; at 4 x 1 two ranks
    share each batch, which leaves the global mean, and so the step, the same)."""
    out = []
    for s in range(first, first + steps):
        loss = model(*_tp.batch(s, dist.get_rank() // 2))
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append(t.item() / dist.get_world_size())
    return out


def torch_full(model, opt) -> dict:
    """``fqn`` and ``fqn:key`` full tensors of an FSDP2 + TP model and its optimizer (DCP's state-dict API)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    out = {k: v.detach().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        out.update({f"{fqn}:{k}": v.detach().clone() for k, v in st.items() if k != "step"})
    return out


def ours_full(model, opt) -> dict:
    """The same keys from our 2-D (or plain) model: full params, optimizer moments assembled from every piece."""
    out = dict(fp.full_state_dict(model, rank0_only=False))
    for k in ("exp_avg", "exp_avg_sq"):
        out.update({f"{n}:{k}": v for n, v in _tp.full_of(model, lambda p, k=k: opt.state[p].get(k)).items()})
    return out


def torch_save_worker(rank, world, path):
    """FSDP2 + TP: two steps, dcp.save of get_state_dict, full state, one more step's loss."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = fsdp2_tp()
    opt = _tp.make_optimizer("adamw", model.parameters())
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd, "extra": {"step": 2}}, checkpoint_id=path)
    return torch_full(model, opt), _train(model, opt, 1, 2)


def ours_load_worker(rank, world, path, layout):
    """Ours at ``layout`` (different initial values), fp.load_checkpoint of torch's DCP directory: full state,
    the next step's loss."""
    torch.manual_seed(5)
    model, opt, _, _ = _tp.build_layout(layout)
    for p in model.parameters():          # nothing of the initialization may survive the load
        p.data.fill_(7.0)
    assert fp.load_checkpoint(path, model, opt) == {"extra": {"step": 2}}
    return ours_full(model, opt), _train(model, opt, 1, 2)


def ours_save_worker(rank, world, path):
    """Ours at 2 x 2: two steps, fp.save_checkpoint, full state, one more step's loss."""
    model, opt, _, _ = _tp.build_layout("2x2")
    _train(model, opt, 2)
    fp.save_checkpoint(path, model, opt, extra={"step": 2})
    return ours_full(model, opt), _train(model, opt, 1, 2)


def torch_load_worker(rank, world, path):
    """FSDP2 + TP reading our checkpoint exported to DCP: dcp.load + set_state_dict, full state, next loss."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model = fsdp2_tp()
    opt = _tp.make_optimizer("adamw", model.parameters())
    _train(model, opt, 1, 7)            # state to overwrite (optimizer state exists, values differ)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optimizer": osd, "extra": {"step": 0}}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    assert sd["extra"] == {"step": 2}, sd["extra"]
    return torch_full(model, opt), _train(model, opt, 1, 2)


# ------------------------------------------------------------------ fp.plan at 2 x 2 against the engine
#: ``fp.plan`` keywords and the matching ``fp.shard`` ones, by feature name
FEATURES = {"": ({}, {}), "ac": ({"activation_checkpointing": True}, {"activation_checkpointing": True}),
            "bf16": ({"mixed_precision": "bf16"}, {"mixed_precision": fp.MixedPrecision(param_dtype=torch.bfloat16)})}


def plan_worker(rank, world, strategy, which="toy", feature=""):
    """The toy GPT (or the tiny Llama on its tp_plan) at 2 x 2, ``strategy`` over dp: the engine's dp bytes per
    step (fp.comm_stats, steps 1-2 after a warm-up), this rank's flat shard and AdamW state bytes, and the TP
    group's (bytes, calls) per kind in step 2's forward and backward."""
    if which == "toy":
        model, mesh = _tp.build_2d((2,), 2, sharding_strategy=strategy, **FEATURES[feature][1])
        def step(s):
            return model(*_tp.batch(s, rank // 2))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_hf(_tp.llama(), mesh["tp"])
        fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={LlamaDecoderLayer}, sharding_strategy=strategy)
        def step(s):
            idx = _tp.llama_batch(s, rank // 2)
            return model(input_ids=idx, labels=idx).loss
    opt = _tp.make_optimizer("adamw", model.parameters())
    tp = _TPTraffic(mesh["tp"].get_group())
    for s in range(3):
        if s == 1:
            fp.comm_stats.reset()
        with tp.mode if s == 2 else contextlib.nullcontext():
            step(s).backward()
        opt.step()
        opt.zero_grad()
    wire = {k: v // 2 for k, v in fp.comm_stats.bytes.items() if k != "control"}
    handles = [h for u in model._fp_root.units for h in u.handles]
    shards = sum(h.chunk * h.dtype.itemsize for h in handles)
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for k, v in st.items() if k != "step")
    return wire, shards, state, (tp.bytes, tp.calls)


class _TPTraffic:
    """Ring bytes and calls per kind of the collectives torch runs on the TP group (DTensor's functional
    collectives; c10d ops too), counted at dispatch with fp.comm_stats' formula."""

    _KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor":
              "reduce_scatter", "allreduce_": "all_reduce", "allgather_into_tensor_coalesced": "all_gather"}

    def __init__(self, group):
        from torch.utils._python_dispatch import TorchDispatchMode
        self.name, self.n = group.group_name, group.size()
        self.bytes, self.calls = {}, {}
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer._see(func, args)
                return func(*args, **(kwargs or {}))
        self.mode = Mode()

    def _see(self, func, args) -> None:
        ns, op = func.namespace, func._opname
        if ns not in ("_c10d_functional", "c10d") or op not in self._KINDS:
            return
        group = args[-1] if ns == "_c10d_functional" else args[1]
        if (group if isinstance(group, str) else getattr(group, "group_name", None)) != self.name:
            return
        t = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
        kind = self._KINDS[op]
        full = t.numel() * t.element_size() * (self.n if kind == "all_gather" else 1)
        self.bytes[kind] = self.bytes.get(kind, 0) + (2 if kind == "all_reduce" else 1) * full * (self.n - 1) // self.n
        self.calls[kind] = self.calls.get(kind, 0) + 1


def toy_inputs():
    """One micro-batch of the toy GPT (for `fsdp-plugin plan --inputs`)."""
    return _tp.batch(0, 0)


def stream_worker(rank, world, which):
    """fp.iter_full_params of the 2 x 2 toy GPT / Llama on every rank (names="module" and "hf"), and its
    full_state_dict."""
    if which == "toy":
        model, _ = _tp.build_2d((2,), 2)
    else:
        model = _trained_llama()
    full = fp.full_state_dict(model, rank0_only=False)
    meta = fp.full_params_meta(model, names="hf")
    got = {n: t.clone() for n, t in fp.iter_full_params(model, names="module", ranks="all")}
    hf = {n: t.clone() for n, t in fp.iter_full_params(model, names="hf", ranks="all", bucket_bytes=1 << 12)}
    return full, got, hf, meta
