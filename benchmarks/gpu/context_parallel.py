"""Issue 54's device checks: context parallel attention on CUDA kernels, two ranks on one GPU (gloo, CUDA tensors).

    python benchmarks/gpu/context_parallel.py [--dry]    # --dry: the same rows on CPU, tiny sizes

Rows (one ``GPU_CHECK_JSON {...}`` each):

1. ``cp_parity``: a tiny Llama (GQA) in fp32 at cp 2, 4 AdamW steps, every step's loss and the final parameters
   against one process on the whole sequence on the same GPU (<= 1e-5), for the all-gather and the ring mode.
2. ``cp_bf16_vs_sdpa``: the bf16 loss of one forward at cp 2 against one process under each SDPA kernel that
   runs here (flash, efficient, cuDNN, math): the split is within the kernels' own spread.
3. ``cp_memory``: peak memory per rank of two AdamW steps on one long sequence, cp 1 (data parallel, the whole
   sequence on each rank) then cp 2 on the same ranks; ``ratio`` = cp 2 / cp 1 (all-gather); the ring's cp 2 peak
   beside it.
4. ``cp_plan``: ``fp.plan``'s peak per rank for the same job at cp 1 and cp 2 against row 3's measurement
   (within 20%).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _one_gpu import device, emit, error_text, peak_mib, reset_peak, spawn  # noqa: E402

STEPS, VOCAB = 4, 128
MODES = ("allgather", "ring")


def _adamw(params):
    # the parity tests' AdamW (tests/_parity.py): a larger step turns float noise in near-zero gradients into +-lr
    return torch.optim.AdamW(params, lr=2e-3, eps=1e-6, weight_decay=0.1)


def _llama(dtype=torch.float32, hidden=64, layers=2, seq=256):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=seq, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(cfg).to(dtype).train()


def _batch(step, seq):
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": ids.clone()}


def _one_row(seq):
    return {k: v[:1] for k, v in _batch(0, seq).items()}


def _to(batch, dev):
    return {k: v.to(dev) for k, v in batch.items()}


def _parity_worker(rank, world, dev, seq, mode="allgather"):
    import fsdp_plugin as fp
    model = fp.shard(_llama(seq=seq).to(dev), context_parallel=2, context_parallel_attention=mode, device=dev)
    opt = _adamw(model.parameters())
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = model(**_to(_batch(s, seq), dev)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {k: v.float().flatten().tolist() for k, v in fp.full_state_dict(model).items()}
    return {"losses": losses, "state": state}


def _worker(rank, world, dev, sizes):
    """The three rows' sharded halves in one spawn (each spawn costs two CUDA and transformers start-ups)."""
    return {"parity": {m: _parity_worker(rank, world, dev, sizes["parity"], m) for m in MODES},
            "bf16": _bf16_worker(rank, world, dev, sizes["bf16"]),
            "memory": _memory_worker(rank, world, dev, *sizes["memory"])}


def parity_row(dry: bool, got: dict, seq: int) -> dict:
    dev = device(dry)
    model = _llama(seq=seq).to(dev)
    opt = _adamw(model.parameters())
    want = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = model(**_to(_batch(s, seq), dev)).loss
        loss.backward()
        opt.step()
        want.append(loss.item())
    row = {"check": "cp_parity", "cp": 2, "seq": seq, "ok": True}
    for mode in MODES:
        loss_diff = max(abs(a - b) for a, b in zip(got[mode]["losses"], want))
        param_diff = max((torch.tensor(got[mode]["state"][k]) - v.detach().float().cpu().flatten()).abs().max().item()
                         for k, v in model.state_dict().items() if k in got[mode]["state"])
        row[mode] = {"max_loss_diff": loss_diff, "max_param_diff": param_diff}
        row["ok"] &= loss_diff <= 1e-5 and param_diff <= 1e-5
    return row


def _bf16_worker(rank, world, dev, seq):
    import fsdp_plugin as fp
    model = fp.shard(_llama(torch.bfloat16, seq=seq).to(dev), context_parallel=2, device=dev)
    with torch.no_grad():
        return {"loss": model(**_to(_batch(0, seq), dev)).loss.float().item()}


def bf16_row(dry: bool, got: dict, seq: int) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    got = got["loss"]
    dev = device(dry)
    model = _llama(torch.bfloat16, seq=seq).to(dev)
    kernels = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel(getattr(SDPBackend, name)), torch.no_grad():
                kernels[name.lower()] = model(**_to(_batch(0, seq), dev)).loss.float().item()
        except (RuntimeError, AttributeError) as e:       # not built, or refused for this device / shape
            kernels[name.lower()] = str(e).splitlines()[0][:80]
    ran = [v for v in kernels.values() if isinstance(v, float)]
    spread = max(ran) - min(ran) if ran else None
    diff = max(abs(got - v) for v in ran) if ran else None
    # bf16's unit roundoff is 2^-8: a loss of ~4.9 moves by up to ~0.02 between kernels' summation orders
    return {"check": "cp_bf16_vs_sdpa", "seq": seq, "cp_loss": got, "kernels": kernels, "kernel_spread": spread,
            "max_diff_to_a_kernel": diff, "ok": diff is not None and diff <= max(0.05, 2 * (spread or 0))}


def _memory_worker(rank, world, dev, seq, hidden):
    import fsdp_plugin as fp
    peaks = {}
    for cp, mode in ((1, "allgather"), (2, "allgather"), (2, "ring")):
        model = fp.shard(_llama(torch.bfloat16, hidden=hidden, seq=seq).to(dev), context_parallel=cp,
                         context_parallel_attention=mode, device=dev)
        batch = _to(_one_row(seq), dev)
        opt = _adamw(model.parameters())
        reset_peak(dev)
        for _ in range(2):             # the second step holds AdamW's state too, as fp.plan's peak does
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad()
        peaks[cp if mode == "allgather" else f"{cp}-{mode}"] = peak_mib(dev)
        del model, opt
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return {"peak_mib": peaks}


def memory_row(dry: bool, got: dict, sizes) -> dict:
    seq, hidden = sizes
    got = got["peak_mib"]
    one, two = got.get("1"), got.get("2")
    ratio = round(two / one, 3) if one and two else None
    return {"check": "cp_memory", "seq": seq, "hidden": hidden, "peak_mib_cp1": one, "peak_mib_cp2": two,
            "peak_mib_cp2_ring": got.get("2-ring"), "ratio": ratio, "ok": dry or (ratio is not None and ratio < 0.8)}


def plan_row(dry: bool, got: dict, sizes) -> dict:
    """fp.plan's peak per rank for the memory row's job (cp 1 and 2 at world 2, AdamW) against what it measured."""
    import fsdp_plugin as fp
    seq, hidden = sizes
    measured = got["peak_mib"]
    row = {"check": "cp_plan", "seq": seq}
    for cp in (1, 2):
        p = fp.plan(lambda: _llama(torch.bfloat16, hidden=hidden, seq=seq), world_size=2, context_parallel=cp,
                    inputs=lambda: _one_row(seq), device="cpu" if dry else "cuda")
        row[f"plan_mib_cp{cp}"] = round(p.peak_bytes[2] / 2**20, 1)
        row[f"measured_mib_cp{cp}"] = measured.get(str(cp))
    ratios = [row[f"measured_mib_cp{cp}"] / row[f"plan_mib_cp{cp}"] for cp in (1, 2) if row[f"measured_mib_cp{cp}"]]
    row["measured_over_plan"] = [round(r, 3) for r in ratios]
    row["ok"] = dry or (len(ratios) == 2 and all(0.8 <= r <= 1.2 for r in ratios))
    return row


def main() -> int:
    dry = "--dry" in sys.argv
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a GPU machine (or --dry)")
        return 0
    # parity: odd, padded to a multiple of 2C; memory: (tokens, hidden)
    sizes = {"parity": 33, "bf16": 64, "memory": (128, 64)} if dry else \
        {"parity": 255, "bf16": 1024, "memory": (16384, 256)}
    try:
        got = spawn(_worker, 2, dry, sizes)
    except Exception as e:  # noqa: BLE001 - reported as the section's row
        return 0 if emit({"check": "cp_ranks", "ok": False, "error": error_text(e)}) else 1
    ok = True
    for make in (parity_row, bf16_row, memory_row, plan_row):
        name = make.__name__.removesuffix("_row")
        try:
            row = make(dry, got["memory" if name == "plan" else name], sizes["memory" if name == "plan" else name])
        except Exception as e:  # noqa: BLE001 - the row reports it; the other rows still run
            row = {"check": f"cp_{name}", "ok": False, "error": error_text(e)}
        ok &= emit(row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
