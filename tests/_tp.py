"""Tensor-parallel test pieces: a toy GPT with every TP case, its plan, the dp x tp worker and the reference.

Every TP case of issue 31: a plain (replicated) embedding, colwise q/k/v (heads split over TP), rowwise o with
a bias (Replicate), an MLP of odd width 17 (colwise 9/8, rowwise), a SequenceParallel final norm (Replicate
weight whose gradient is Partial), a colwise head gathered back to full logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fsdp_plugin as fp

V, D, H, FF, T = 32, 16, 4, 17, 8


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o = nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, D // H).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, FF), nn.Linear(FF, D)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class TPBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(D), Attn(), nn.LayerNorm(D), MLP()

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Final(nn.Module):
    """The final norm, in a module of its own so the plan can seq-shard its input before SequenceParallel."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.norm(x)


class TPGPT(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(TPBlock() for _ in range(layers))
        self.final = Final()
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.final(x))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def tp_plan(layers: int = 2) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    plan = {"final": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
            "final.norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(layers):
        for name in ("q", "k", "v"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o"] = RowwiseParallel()
        # a DTensor output keeps the uneven global width (17) for the rowwise input (a local one would not)
        plan[f"blocks.{i}.mlp.up"] = ColwiseParallel(use_local_output=False)
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
    return plan


def batch(step: int, dp_rank: int, size: int = 2):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    idx = torch.randint(0, V, (size, T), generator=g)
    return idx, torch.roll(idx, -1, 1)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=2e-3, eps=1e-6, weight_decay=0.1)


def reference(dp: int, optim: str, steps: int, clip=None):
    """One process on the global batch: per step (loss, {name: grad}, {name: param}, grad norm or None)."""
    torch.manual_seed(0)
    model = TPGPT()
    opt = make_optimizer(optim, model.parameters())
    out = []
    for s in range(steps):
        xs, ys = zip(*[batch(s, r) for r in range(dp)])
        loss = model(torch.cat(xs), torch.cat(ys))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip is not None else None
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append((loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}, norm))
    return out


def build_2d(dp_shape: tuple, tp: int, **shard_kwargs):
    """The toy GPT parallelized on mesh['tp'] and sharded over the dp dims; returns (model, mesh)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    names = ("dp_replicate", "dp_shard", "tp") if len(dp_shape) == 2 else ("dp", "tp")
    mesh = init_device_mesh("cpu", (*dp_shape, tp), mesh_dim_names=names)
    torch.manual_seed(0)
    model = TPGPT()
    parallelize_module(model, mesh["tp"], tp_plan())
    dp_mesh = mesh[names[:-1]] if len(dp_shape) == 2 else mesh["dp"]
    fp.shard(model, device_mesh=dp_mesh, auto_wrap_policy={TPBlock}, **shard_kwargs)
    return model, mesh


def full_grads(model) -> dict:
    """Every parameter's full gradient (dp pieces all-gathered, TP boxes assembled); every rank."""
    return full_of(model, lambda p: p.grad)


def full_of(model, get) -> dict:
    """``get(param)`` (a tensor shaped like the piece, or None: zeros) assembled to full tensors; every rank."""
    from fsdp_plugin._flat.dtensor import full_tensor
    out = {}
    for unit in model._fp_root.units:
        for h in unit.handles:
            piece = torch.zeros(h.chunk, dtype=h.dtype)
            for s in h.slots:
                if get(s.param) is not None:
                    piece[h.local_slice(s)] = get(s.param).reshape(-1)
            if h.mesh.shard_size > 1:
                parts = [torch.empty_like(piece) for _ in range(h.mesh.shard_size)]
                dist.all_gather(parts, piece, group=h.mesh.shard_group)
                flat = torch.cat(parts)
            else:
                flat = piece
            for s, spec in zip(h.slots, h._tp):
                v = flat[s.offset:s.offset + s.numel].view(s.shape)
                out[s.fqn] = full_tensor(v, spec) if spec is not None else v.clone()
    return out


def worker(rank, world, dp_shape, tp, optim, steps, strategy="full_shard", clip=None):
    """Per step: (global mean loss, full grads, full params) on every rank."""
    kwargs = {"sharding_strategy": strategy}
    model, mesh = build_2d(dp_shape, tp, **kwargs)
    dp_rank = rank // tp
    opt = make_optimizer(optim, model.parameters())
    out = []
    for s in range(steps):
        loss = model(*batch(s, dp_rank))
        opt.zero_grad()
        loss.backward()
        norm = fp.clip_grad_norm_(model, clip) if clip is not None else None
        grads = full_grads(model)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        state = fp.full_state_dict(model, rank0_only=False)
        out.append((t.item() / world, grads, state, None if norm is None else norm.item()))
    return out


def assert_matches(got: list, want: list, tol: float = 1e-5) -> None:
    """Per step: loss, every full gradient, every full parameter (and the clipped norm) within ``tol``."""
    assert len(got) == len(want)
    for s, ((loss, grads, params, norm), (w_loss, w_grads, w_params, w_norm)) in enumerate(zip(got, want)):
        assert abs(loss - w_loss) <= tol, f"step {s}: loss {loss} vs {w_loss}"
        assert set(grads) == set(w_grads) and set(params) == set(w_params)
        for k in w_grads:
            d = (grads[k] - w_grads[k]).abs().max().item()
            assert d <= tol, f"step {s}: grad of {k} off by {d:.3e}"
        for k in w_params:
            d = (params[k] - w_params[k]).abs().max().item()
            assert d <= tol, f"step {s}: {k} off by {d:.3e}"
        if w_norm is not None:
            assert abs(norm - w_norm) <= tol * max(1.0, w_norm), f"step {s}: norm {norm} vs {w_norm}"


# ------------------------------------------------------------------ refused layouts (world 2: dp 1 x tp 2)
def _mesh_1x2():
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))


def _colwise(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    torch.manual_seed(0)
    return parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh["tp"], {"0": ColwiseParallel()})


def _with_param(mesh_for_param, placements):
    from torch.distributed.tensor import distribute_tensor
    m = nn.Sequential(nn.Linear(4, 4))
    m[0].weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh_for_param, placements))
    return m


def refuse_partial(rank, world):
    from torch.distributed.tensor import DTensor, Partial
    mesh = _mesh_1x2()
    m = nn.Sequential(nn.Linear(4, 4))
    m[0].weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    fp.shard(m, device_mesh=mesh["dp"])


def refuse_strided(rank, world):
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh = _mesh_1x2()
    fp.shard(_with_param(mesh["tp"], [_StridedShard(0, split_factor=2)]), device_mesh=mesh["dp"])


def refuse_two_dims(rank, world):
    from torch.distributed.tensor import Shard
    mesh = _mesh_1x2()
    fp.shard(_with_param(mesh, [Shard(0), Shard(1)]), device_mesh=mesh["dp"])


def refuse_no_dp_mesh(rank, world):
    fp.shard(_colwise(_mesh_1x2()))


def refuse_foreign_root(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    other = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    fp.shard(_colwise(_mesh_1x2()), device_mesh=other["a"])


def refuse_fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard      # the test may use torch's FSDP2; the engine never does
    mesh = _mesh_1x2()
    m = _colwise(mesh)
    fully_shard(m, mesh=mesh["dp"])
    fp.shard(m, device_mesh=mesh["dp"])


def refuse_per_tensor_optimizer(rank, world):
    mesh = _mesh_1x2()
    m = fp.shard(_colwise(mesh), device_mesh=mesh["dp"])
    opt = torch.optim.Adafactor(m.parameters())
    m(torch.ones(2, 4)).sum().backward()
    opt.step()


def refuse_stale_optimizer(rank, world):
    mesh = _mesh_1x2()
    m = _colwise(mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    fp.shard(m, device_mesh=mesh["dp"])
    m(torch.ones(2, 4)).sum().backward()
    opt.step()


def refuse_small_mesh_without_tp(rank, world):
    mesh = _mesh_1x2()
    fp.shard(nn.Sequential(nn.Linear(4, 4)), device_mesh=mesh["dp"])


def refuse_cp_mesh_without_cp_dim(rank, world):
    """context_parallel with a 1-D DeviceMesh: which of its ranks split a sequence is not said (issue 54)."""
    from torch.distributed.device_mesh import init_device_mesh
    fp.shard(llama(), device_mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), context_parallel=2)


# ------------------------------------------------------------------ checkpoints across (dp, tp) layouts
LAYOUTS = {"2x2": (4, (2,), 2), "4x1": (4, (4,), 1), "1x4": (4, (1,), 4), "1x2": (2, (1,), 2), "1": (1, (1,), 1),
           "h1x2x2": (4, (1, 2), 2)}


def global_batch(step: int, rows: int = 4):
    g = torch.Generator().manual_seed(500 + step)
    idx = torch.randint(0, V, (rows, T), generator=g)
    return idx, torch.roll(idx, -1, 1)


def my_rows(step: int, dp_rank: int, dp: int):
    idx, tgt = global_batch(step)
    k = idx.shape[0] // dp
    return idx[dp_rank * k:(dp_rank + 1) * k], tgt[dp_rank * k:(dp_rank + 1) * k]


def build_layout(layout: str):
    """(model, optimizer, dp_rank, dp): tp 1 means a plain model (no DTensor) sharded over the world."""
    world, dp_shape, tp = LAYOUTS[layout]
    if tp == 1:
        torch.manual_seed(0)
        model = fp.shard(TPGPT(), auto_wrap_policy={TPBlock})
    else:
        strategy = "hybrid_shard" if len(dp_shape) == 2 else "full_shard"
        model, _ = build_2d(dp_shape, tp, sharding_strategy=strategy)
    opt = make_optimizer("adamw", model.parameters())
    rank = dist.get_rank() if dist.is_initialized() else 0
    return model, opt, rank // tp, world // tp


def _step(model, opt, s, dp_rank, dp) -> float:
    loss = model(*my_rows(s, dp_rank, dp))
    opt.zero_grad()
    loss.backward()
    opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def _snapshot(model, opt) -> tuple:
    state = fp.full_state_dict(model, rank0_only=False)
    moments = {k: full_of(model, lambda p, k=k: opt.state[p].get(k)) for k in ("exp_avg", "exp_avg_sq")}
    steps = sorted({float(st["step"]) for st in opt.state.values()})
    return state, moments, steps


def ckpt_worker(rank, world, layout, path, mode):
    """``save``: two steps, save, snapshot, one more step; ``load``: load, snapshot, the same third step."""
    model, opt, dp_rank, dp = build_layout(layout)
    if mode == "save":
        for s in range(2):
            _step(model, opt, s, dp_rank, dp)
        fp.save_checkpoint(path, model, opt, extra={"step": 2})
    else:
        assert fp.load_checkpoint(path, model, opt) == {"step": 2}
    snap = _snapshot(model, opt)
    return snap, _step(model, opt, 2, dp_rank, dp)


# ------------------------------------------------------------------ transformers Llama with its own tp_plan
def llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                       attn_implementation="eager")


def llama():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config()).float()


def llama_batch(step: int, dp_rank: int):
    g = torch.Generator().manual_seed(77 * step + dp_rank)
    idx = torch.randint(0, 64, (2, T), generator=g)
    return idx


def llama_reference(dp: int, steps: int):
    model = llama()
    opt = make_optimizer("adamw", model.parameters())
    out = []
    for s in range(steps):
        idx = torch.cat([llama_batch(s, r) for r in range(dp)])
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append((loss.item(), grads, {n: p.detach().clone() for n, p in model.state_dict().items()}, None))
    return out


def llama_worker(rank, world, steps):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_hf(llama(), mesh["tp"])
    fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={LlamaDecoderLayer})
    opt = make_optimizer("adamw", model.parameters())
    out = []
    for s in range(steps):
        idx = llama_batch(s, rank // 2)
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        grads = full_grads(model)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append((t.item() / world, grads, fp.full_state_dict(model, rank0_only=False), None))
    return out


# ------------------------------------------------------------------ features on a TP model
def features_worker(rank, world, feature):
    """One step under ``feature`` on the 2 x 2 toy GPT; returns (global loss, full grads) to compare with the
    plain fp32 step on the global batch."""
    kwargs = {}
    if feature == "bf16":
        kwargs["mixed_precision"] = fp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if feature == "checkpointing":
        kwargs["activation_checkpointing"] = True
    model, _ = build_2d((2,), 2, **kwargs)
    dp_rank = rank // 2
    idx, tgt = batch(0, dp_rank)
    if feature == "no_sync":     # two half micro-batches, the first without communication
        with fp.no_sync(model):
            (model(idx[:1], tgt[:1]) / 2).backward()
        loss = model(idx[1:], tgt[1:]) / 2
        loss.backward()
        loss = loss * 2   # report the second half's loss (unused by the comparison of gradients)
    else:
        loss = model(idx, tgt)
        loss.backward()
    with fp.full_params(model):    # full_params shows DTensors again: full_tensor() gives the global values
        names = {n: p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                 for n, p in model.named_parameters()}
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world, full_grads(model), names


def llama_load_worker(rank, world, hf_dir, on_meta):
    """A Llama parallelized by its tp_plan (on the meta device with ``on_meta``), sharded over dp, filled by
    fp.load_pretrained from plain HF safetensors: its full state, every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(1)      # other values than the file's
    if on_meta:
        with torch.device("meta"):
            model = LlamaForCausalLM(llama_config())
    else:
        model = LlamaForCausalLM(llama_config())
    parallelize_hf(model, mesh["tp"])
    fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={LlamaDecoderLayer},
             param_init_fn="skip" if on_meta else None)
    fp.load_pretrained(model, hf_dir)
    return fp.full_state_dict(model, rank0_only=False)


def refuse_plan(rank, world):
    fp.plan(_colwise(_mesh_1x2()), world_size=1)


def comm_worker(rank, world):
    """One 2 x 2 step: (reduce-scatter calls, bytes), what the handles predict, and local vs global numel."""
    from fsdp_plugin._comm.collectives import ring_bytes
    model, _ = build_2d((2,), 2)
    handles = [h for u in model._fp_root.units for h in u.handles]
    fp.comm_stats.reset()
    loss = model(*batch(0, rank // 2))
    loss.backward()
    calls, nbytes = fp.comm_stats.calls["reduce_scatter"], fp.comm_stats.bytes["reduce_scatter"]
    want = sum(ring_bytes(h.padded, h.reduce_dtype.itemsize, h.mesh.shard_size) for h in handles if h.requires_grad)
    local = sum(h.total for h in handles)
    return calls, nbytes, len([h for h in handles if h.requires_grad]), want, local


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager",
                        router_aux_loss_coef=0.0)
    return MixtralForCausalLM(cfg).float()


def hf_reference(build, dp: int, steps: int):
    model = build()
    opt = make_optimizer("adamw", model.parameters())
    out = []
    for s in range(steps):
        idx = torch.cat([llama_batch(s, r) for r in range(dp)])
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append((loss.item(), grads, {n: p.detach().clone() for n, p in model.state_dict().items()}, None))
    return out


def hf_worker(rank, world, build_name, block_name, steps, drop=None):
    from torch.distributed.device_mesh import init_device_mesh
    from fsdp_plugin.integrations.hf_tensor_parallel import parallelize_hf
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = globals()[build_name]()
    plan = {k: v for k, v in model.tp_plan.items() if drop is None or drop not in k}
    model = parallelize_hf(model, mesh["tp"], plan)
    block = next(type(m) for m in model.modules() if type(m).__name__ == block_name)
    fp.shard(model, device_mesh=mesh["dp"], auto_wrap_policy={block})
    opt = make_optimizer("adamw", model.parameters())
    out = []
    for s in range(steps):
        idx = llama_batch(s, rank // 2)
        loss = model(input_ids=idx, labels=idx).loss
        opt.zero_grad()
        loss.backward()
        grads = full_grads(model)
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        out.append((t.item() / world, grads, fp.full_state_dict(model, rank0_only=False), None))
    return out
