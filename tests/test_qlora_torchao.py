"""torchao's ``NF4Tensor`` bases (torchtune's QLoRA: ``nn.Parameter(to_nf4(w), requires_grad=False)`` and
``linear_nf4``) sharded exactly (``_flat/packed.py``: the inner tensors' bytes in a uint8 carrier).

A tiny stack of NF4 linears with plain-torch LoRA adapters, built identically on every rank and in one process.
What must hold at world 2:

* each rank holds about half of the NF4 inner tensors' bytes, together all of them;
* the weight forward sees, and ``fp.full_params`` shows, an ``NF4Tensor`` whose inner tensors equal the original's
  byte for byte, under ``MixedPrecision(param_dtype=bfloat16)`` too (a cast of the payload would rewrite them);
* fp32 losses and the trained LoRA weights within 1e-5 of one process over 4 AdamW steps (plain torch LoRA, and
  PEFT's LoRA on ``nn.Linear`` layers holding NF4 weights, saved by PEFT's own ``save_pretrained``);
* ``fp.plan`` counts the NF4 weights as the bytes fp.shard shards;
* ``fp.full_state_dict`` holds the NF4Tensor, as the plain model's ``state_dict()`` does; ``fp.save_pretrained``
  and ``fp.iter_full_params`` refuse by name; other torchao subclasses and trainable NF4 weights are refused.

The broken variant (``_cast_payload``: the carrier's bytes cast as a 16-bit floating handle's would be) must fail the
bit-identity and parity checks: the checks can fail.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from _dist import run_ranks

import fsdp_plugin as fp

try:    # torchao 0.18 is pinned for torch 2.13 (.ci/run); other lanes' torch may not import it
    nf4 = importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
except Exception as e:   # noqa: BLE001 - ImportError, or torchao's own version checks
    pytest.skip(f"torchao's NF4 does not import here: {e}", allow_module_level=True)

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

WORLD, STEPS, DIM, TOL = 2, 4, 128, 1e-5
INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


class NF4LoRA(nn.Module):
    """torchtune's ``LoRALinear(quantize_base=True)`` in miniature: a frozen NF4 base through ``linear_nf4``."""

    def __init__(self, din: int, dout: int, rank: int = 4):
        super().__init__()
        w = torch.randn(dout, din) / din ** 0.5
        self.weight = nn.Parameter(nf4.to_nf4(w), requires_grad=False)   # block 64, scaler block 256
        self.lora_a = nn.Linear(din, rank, bias=False)
        self.lora_b = nn.Linear(rank, dout, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.05)    # nonzero: both adapters get gradients from step 0

    def forward(self, x):
        return nf4.linear_nf4(x, self.weight) + self.lora_b(self.lora_a(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([NF4LoRA(DIM, DIM) for _ in range(3)])
        self.head = nn.Linear(DIM, 8)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _batch(step: int, rank: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4 * WORLD, DIM, generator=g), torch.randint(0, 8, (4 * WORLD,), generator=g)
    n = 4 * WORLD // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _inner(t) -> dict:
    t = t.detach()   # the values' bytes (new_empty: row-major; NF4's one-element factor has stride 256)
    return {n: getattr(t, n).new_empty(getattr(t, n).shape).copy_(getattr(t, n)).reshape(-1).view(torch.uint8)
            for n in INNER}


def _train(model, rank: int, world: int) -> list:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for s in range(STEPS):
        x, y = _batch(s, rank, world)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        if world > 1:
            import torch.distributed as dist
            dist.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def _lora(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if "lora_" in k or k.startswith("head.")}


def _one_process():
    model = Net()
    want = {i: _inner(b.weight) for i, b in enumerate(model.blocks)}
    return _train(model, 0, 1), _lora(model.state_dict()), want


def _cast_payload(model) -> None:
    """The broken variant: the carriers' bytes taken as bfloat16 values and cast to float16 and back, as a floating
    handle's would be under ``param_dtype=float16`` (bitsandbytes#1945's canonicalized NF4 bytes)."""
    for b in model.blocks:
        p = b._parameters["weight"]
        p.data.copy_(p.data.view(torch.bfloat16).to(torch.float16).to(torch.bfloat16).view(torch.uint8))


def _sharded(rank, world, mp, broken):
    model = Net()
    want = {i: _inner(b.weight) for i, b in enumerate(model.blocks)}
    total = sum(sum(v.numel() for v in w.values()) for w in want.values())
    fp.shard(model, auto_wrap_policy={NF4LoRA},
             mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16) if mp else None)
    if broken:
        _cast_payload(model)
    local = sum(b._parameters["weight"].numel() for b in model.blocks)
    seen = {}

    def hook(module, args):     # the weight forward sees (the engine registered its view before this hook)
        seen[id(module)] = (type(module.weight).__name__, _inner(module.weight), module.weight.dtype)

    for b in model.blocks:
        b.register_forward_pre_hook(hook)
    losses = _train(model, rank, world) if not mp else [model(_batch(0, rank, world)[0]).float().sum().item()]
    forward = [seen[id(b)] for b in model.blocks]
    with fp.full_params(model, writeback=False):
        full = [(type(b.weight).__name__, _inner(b.weight), tuple(b.weight.shape), b.weight.requires_grad)
                for b in model.blocks]
    state = fp.full_state_dict(model)
    kinds = {k: type(v).__name__ for k, v in state.items() if k.endswith("weight")}
    state_inner = {k: _inner(v) for k, v in state.items() if type(v).__name__ == "NF4Tensor"}
    return dict(losses=losses, lora=_lora(state) if rank == 0 else {}, local=local, total=total, want=want,
                forward=forward, full=full, kinds=kinds, state_inner=state_inner)


def _check_exact(got: list, mp: bool) -> None:
    for rank, r in enumerate(got):
        for i, (cls, inner, dtype) in enumerate(r["forward"]):
            assert cls == "NF4Tensor" and dtype == torch.float32, (rank, i, cls, dtype)
            for n in INNER:
                assert torch.equal(inner[n], r["want"][i][n]), f"rank {rank} block {i}: forward {n} changed"
        for i, (cls, inner, shape, rg) in enumerate(r["full"]):
            assert cls == "NF4Tensor" and shape == (DIM, DIM) and not rg, (rank, i, cls, shape, rg)
            for n in INNER:
                assert torch.equal(inner[n], r["want"][i][n]), f"rank {rank} block {i}: full_params {n} changed"
    r0 = got[0]
    assert r0["kinds"] == {**{f"blocks.{i}.weight": "NF4Tensor" for i in range(3)}, "head.weight": "Tensor",
                           **{f"blocks.{i}.lora_{a}.weight": "Tensor" for i in range(3) for a in "ab"}}, r0["kinds"]
    for i in range(3):
        for n in INNER:
            assert torch.equal(r0["state_inner"][f"blocks.{i}.weight"][n], r0["want"][i][n]), (i, n)
    # sharded: each rank ~1/world of the inner tensors' bytes (row padding at most one element per block and
    # rank), together all of them
    local = [r["local"] for r in got]
    assert sum(local) == r0["total"] and max(local) <= r0["total"] / WORLD + 3 * WORLD, (local, r0["total"])


def test_nf4_base_sharded_exactly_and_matches_one_process():
    want_losses, want_lora, _ = _one_process()
    got = run_ranks(_sharded, WORLD, False, False, timeout=120)
    _check_exact(got, mp=False)
    for rank, r in enumerate(got):
        diff = max(abs(a - b) for a, b in zip(r["losses"], want_losses))
        assert diff <= TOL, f"rank {rank}: loss drift {diff:.2e}\n got {r['losses']}\nwant {want_losses}"
    lora = got[0]["lora"]
    assert lora.keys() == want_lora.keys() and len(lora) == 8
    for k, v in want_lora.items():
        assert (lora[k] - v).abs().max().item() <= TOL, k


def test_nf4_payload_never_cast_under_mixed_precision():
    """bf16 compute: the weight is still the float32 NF4Tensor, its bytes uncast (``linear_nf4`` dequantizes it
    to the input's dtype itself)."""
    _check_exact(run_ranks(_sharded, WORLD, True, False, timeout=120), mp=True)


def test_a_cast_payload_fails_the_checks():
    """The broken variant: the same checks must fail when the carrier's bytes went through a bf16 cast."""
    want_losses, _, _ = _one_process()
    got = run_ranks(_sharded, WORLD, False, True, timeout=120)
    with pytest.raises(AssertionError, match="changed"):
        _check_exact(got, mp=False)
    assert max(abs(a - b) for a, b in zip(got[0]["losses"], want_losses)) > TOL


def _export_worker(rank, world, out):
    model = Net()
    fp.shard(model, auto_wrap_policy={NF4LoRA})
    msgs = []
    with pytest.raises(fp.ShardingError) as err:
        fp.save_pretrained(model, out)
    msgs.append(str(err.value))
    with pytest.raises(fp.ShardingError) as err:
        list(fp.iter_full_params(model))
    msgs.append(str(err.value))
    return msgs


def test_nf4_exports_refused_by_name(tmp_path):
    for msg in run_ranks(_export_worker, WORLD, str(tmp_path / "out"), timeout=120)[0]:
        assert "torchao NF4Tensor weight 'blocks.0.weight'" in msg and "fp.full_state_dict" in msg, msg


class PeftBlock(nn.Module):
    """A plain ``nn.Linear`` holding an NF4 weight (torchao's ``F.linear`` override runs it), for PEFT's LoRA."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.proj.weight = nn.Parameter(nf4.to_nf4(self.proj.weight.detach()), requires_grad=False)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def _peft_model():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    net = nn.Sequential(PeftBlock(), PeftBlock(), nn.Linear(DIM, 8))
    return peft.get_peft_model(net, peft.LoraConfig(r=4, target_modules=["proj"], init_lora_weights="gaussian"))


def _peft_worker(rank, world, out):
    model = _peft_model()
    fp.shard(model, auto_wrap_policy={PeftBlock})
    losses = _train(model, rank, world)
    model.save_pretrained(out)        # PEFT's own adapter save on the sharded model (every rank calls it)
    return losses


def test_peft_lora_on_an_nf4_base_matches_one_process(tmp_path):
    """PEFT's LoRA on ``nn.Linear`` layers holding NF4 weights: losses within 1e-5 of one process; PEFT's own
    ``save_pretrained`` writes the adapters (the NF4 base is not in them), equal to one process's."""
    peft = pytest.importorskip("peft")
    one = _peft_model()
    want = _train(one, 0, 1)
    got = run_ranks(_peft_worker, WORLD, str(tmp_path / "adapter"), timeout=120)
    for losses in got:
        assert max(abs(a - b) for a, b in zip(losses, want)) <= TOL, (losses, want)
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    ref = peft.get_peft_model_state_dict(one)
    assert saved.keys() == ref.keys() and len(saved) == 4, sorted(saved)
    for k, v in ref.items():
        assert (saved[k] - v).abs().max().item() <= TOL, k


def _checkpoint_worker(rank, world, ckpt, tmp):
    model = Net()
    fp.shard(model, auto_wrap_policy={NF4LoRA})
    _train(model, rank, world)
    fp.save_checkpoint(ckpt, model)
    with fp.full_params(model, writeback=False):
        want = [_inner(b.weight) for b in model.blocks]
    other = Net()
    fp.shard(other, auto_wrap_policy={NF4LoRA})
    with torch.no_grad():
        for b in other.blocks:
            b._parameters["weight"].fill_(0xFF)     # what the load must overwrite, byte for byte
    fp.load_checkpoint(ckpt, other)
    with fp.full_params(other, writeback=False):
        got = [(type(b.weight).__name__, _inner(b.weight)) for b in other.blocks]
    same = all(cls == "NF4Tensor" and all(torch.equal(g[n], w[n]) for n in INNER) for (cls, g), w in zip(got, want))
    with pytest.raises(fp.ShardingError) as err:
        fp.load_pretrained(other, tmp)
    return same, str(err.value)


def test_nf4_sharded_checkpoint_round_trips_and_load_pretrained_refused(tmp_path):
    """``fp.save_checkpoint`` / ``fp.load_checkpoint`` restore the NF4 bytes exactly; ``fp.load_pretrained`` into
    NF4 weights is refused by name (it would write checkpoint values into packed bytes)."""
    plain = tmp_path / "plain"
    plain.mkdir()
    from safetensors.torch import save_file
    save_file({"head.weight": torch.zeros(8, DIM)}, str(plain / "model.safetensors"))
    for same, msg in run_ranks(_checkpoint_worker, WORLD, str(tmp_path / "ckpt"), str(plain), timeout=120):
        assert same
        assert "torchao NF4 weights ('blocks.0.weight')" in msg and "to_nf4 before fp.shard" in msg, msg


def _shard_bytes_worker(rank, world):
    model = fp.shard(Net(), auto_wrap_policy={NF4LoRA})
    return sum(h.flat_shard.numel() * h.flat_shard.element_size() for u in model._fp_root.units for h in u.handles)


def test_plan_counts_nf4_weights_as_their_bytes():
    """``fp.plan`` counts an NF4 weight as the bytes fp.shard shards (it counted float32 values: 7.7x too many)."""
    plan = fp.plan(Net, world_size=WORLD, auto_wrap_policy={NF4LoRA}, inputs=lambda: (torch.randn(4, DIM),),
                   loss_fn=lambda out: out.sum())
    real = run_ranks(_shard_bytes_worker, WORLD)
    assert plan.worlds[WORLD].param_shards == real[0] == real[1], (plan.worlds[WORLD].param_shards, real)


def _refused_worker(rank, world, what):
    model = Net()
    if what == "trainable":
        model.blocks[1].weight.requires_grad_(True)
    elif what == "other":     # a torchao subclass other than NF4Tensor (its inner tensors unknown here)
        cls = type("Int4Tensor", (torch.Tensor,), {"__module__": "torchao.quantization.fake"})
        model.head.weight = nn.Parameter(torch.zeros(8, DIM).as_subclass(cls), requires_grad=False)
    with pytest.raises(fp.ShardingError) as err:
        fp.shard(model)
    return str(err.value)


@pytest.mark.parametrize("what,expect", [
    ("trainable", "blocks.1.weight is a torchao NF4Tensor weight with requires_grad=True"),
    ("other", "head.weight is a torchao Int4Tensor weight: fp.shard shards torchao's NF4Tensor exactly")])
def test_torchao_weights_that_cannot_be_sharded_exactly_refused_by_name(what, expect):
    msg = run_ranks(_refused_worker, 1, what)[0]
    assert expect in msg, msg
