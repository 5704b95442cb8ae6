"""Issue 56's device checks: a 4-bit bitsandbytes base (nf4) with PEFT LoRA sharded on CUDA, two ranks on one GPU
(gloo, CUDA tensors), against the same quantized model in one process on that GPU.

    python benchmarks/gpu/qlora.py [--dry]    # --dry: the same rows on CPU (bitsandbytes runs 4-bit there)

The device image has no bitsandbytes: ``bash benchmarks/gpu/carry_wheels.sh`` puts its wheel in ``.whl/``.
Rows (one ``GPU_CHECK_JSON {...}`` each):

1. ``qlora_parity``: fp32 compute, uint8 storage, 4 AdamW steps: every step's mean loss and the trained adapters
   within 1e-5 of one process; the 4-bit weights are still ``Params4bit`` with their ``quant_state``; packed base
   bytes per rank against the total.
2. ``qlora_bf16``: bf16 compute and bf16 storage, the same steps: the largest loss difference (reported against
   the bound README's QLoRA section derives).
3. ``qlora_piece_quantize``: the per-shard quantization of ``fp.load_pretrained`` into 4-bit weights
   (``fsdp_plugin/_flat/packed_quantize.py``) with bitsandbytes' CUDA kernel: block-aligned pieces cut at
   unaligned shard boundaries give ``quantize_4bit``'s bytes and ``quant_state`` of the whole weight bit for bit
   (nf4/fp4, double quantization on/off, uint8/bf16 storage, fp32 and bf16 weights).
"""
from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _one_gpu import device, emit, error_text, peak_mib, reset_peak, spawn  # noqa: E402

STEPS, VOCAB, SEQ, BATCH, WORLD = 4, 96, 16, 2, 2


def _save_base(path: str) -> None:
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)


def _build(path: str, dev: torch.device, compute: torch.dtype, storage: torch.dtype):
    import peft
    import transformers as tf
    q = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                              bnb_4bit_quant_storage=storage)
    model = tf.LlamaForCausalLM.from_pretrained(path, quantization_config=q, dtype=compute,
                                                device_map={"": dev.index if dev.type == "cuda" else "cpu"})
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["q_proj", "v_proj", "down_proj"]))
    return model.train()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def _packed(model) -> dict:
    import bitsandbytes as bnb
    return {n: p for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}


def _train(model, dev, batches) -> list:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    out = []
    for x in batches:
        x = x.to(dev)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.detach().float())
    return out


def _worker(rank, world, dev, path, recipes):
    """Every recipe's sharded run in one spawn (each spawn costs two CUDA and transformers start-ups)."""
    return {name: _sharded(rank, world, dev, path, compute, storage) for name, compute, storage, _ in recipes}


def _sharded(rank, world, dev, path, compute, storage):
    import torch.distributed as dist

    import fsdp_plugin as fp
    compute, storage = getattr(torch, compute), getattr(torch, storage)
    model = _build(path, dev, compute, storage)
    states = {n: p.quant_state for n, p in _packed(model).items()}
    fp.shard(model, device=dev)
    local = sum(p.numel() * p.element_size() for p in _packed(model).values())
    reset_peak(dev)
    losses = _train(model, dev, [_batch(s, rank) for s in range(STEPS)])
    for t in losses:
        dist.all_reduce(t)
    with fp.full_params(model, writeback=False):
        kept = all(type(p).__name__ == "Params4bit" and p.quant_state is states[n] for n, p in _packed(model).items())
    adapters = {k: v.float().flatten().tolist() for k, v in fp.full_state_dict(model).items() if "lora_" in k}
    return {"losses": [t.item() / world for t in losses], "adapters": adapters, "kept": kept, "local_bytes": local,
            "peak_mib": peak_mib(dev)}


def _one_process(path, dev, compute, storage):
    model = _build(path, dev, compute, storage)
    total = sum(p.numel() * p.element_size() for p in _packed(model).values())
    reset_peak(dev)
    losses = [t.item() for t in _train(model, dev, [torch.cat([_batch(s, r) for r in range(WORLD)])
                                                     for s in range(STEPS)])]
    adapters = {k: v.float().cpu().flatten() for k, v in model.state_dict().items() if "lora_" in k}
    return losses, adapters, total, peak_mib(dev)


def _compare(got, path, dry, compute, storage):
    want, adapters, total, peak = _one_process(path, device(dry), getattr(torch, compute), getattr(torch, storage))
    loss_diff = max(abs(a - b) for a, b in zip(got["losses"], want))
    adapter_diff = max((torch.tensor(got["adapters"][k]) - v).abs().max().item() for k, v in adapters.items())
    return got, {"max_loss_diff": loss_diff, "max_adapter_diff": adapter_diff, "base_bytes_total": total,
                 "base_bytes_rank0": got["local_bytes"], "params4bit_kept": got["kept"],
                 "peak_mib_rank0": got["peak_mib"], "peak_mib_one_process": peak}


def _piece_quantize(dry: bool) -> dict:
    """Row 3: every combination, pieces cut at three unaligned boundaries, compared with the whole weight."""
    import bitsandbytes as bnb

    from fsdp_plugin._flat import packed_quantize as pq
    dev, bad, n = device(dry), [], 0
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(1000, 1030, generator=torch.Generator().manual_seed(0)) * 0.02).to(dev, dtype)
        flat = w.reshape(-1)
        for qt in ("nf4", "fp4"):
            for double in (False, True):
                for storage in (torch.uint8, torch.bfloat16):
                    want, ws = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=double,
                                                            quant_type=qt, quant_storage=storage)
                    p = bnb.nn.Params4bit(w.clone(), requires_grad=False, blocksize=64, compress_statistics=double,
                                          quant_type=qt, quant_storage=storage).to(dev)
                    total, size = p.numel(), p.element_size()
                    got = torch.zeros(total * size, dtype=torch.uint8, device=dev)
                    absmax = torch.zeros(-(-flat.numel() // 64), device=dev)
                    cuts = [0, total // 3 + 1, total // 3 + 7, 2 * total // 3 - 5, total]
                    for start, end in zip(cuts[:-1], cuts[1:]):
                        lo, hi = pq.piece_values(start, end, size, flat.numel(), 64)
                        own, piece = pq.quantize_piece(p, flat[lo:hi].clone(), lo, start, end)
                        got[start * size:end * size] = own
                        absmax[lo // 64:lo // 64 + piece.numel()] = piece
                    st = pq.whole_state(p, absmax)
                    same = torch.equal(got, want.view(-1).view(torch.uint8)) and torch.equal(st.absmax, ws.absmax)
                    if double:
                        same = same and torch.equal(st.offset, ws.offset) and torch.equal(st.state2.absmax,
                                                                                           ws.state2.absmax)
                    n += 1
                    if not same:
                        bad.append(f"{dtype} {qt} double={double} {storage}")
    return {"check": "qlora_piece_quantize", "ok": not bad, "combinations": n, "differ": bad}


def main() -> int:
    dry = "--dry" in sys.argv
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run this on a GPU machine (or --dry)")
        return 0
    recipes = (("qlora_parity", "float32", "uint8", 1e-5), ("qlora_bf16", "bfloat16", "bfloat16", None))
    ok = True
    with tempfile.TemporaryDirectory() as path:
        _save_base(path)
        try:
            sharded = spawn(_worker, WORLD, dry, path, recipes)
        except Exception as e:  # noqa: BLE001 - reported as the section's row
            return 0 if emit({"check": "qlora_ranks", "ok": False, "error": error_text(e)}) else 1
        for name, compute, storage, tol in recipes:
            try:
                _, row = _compare(sharded[name], path, dry, compute, storage)
                fits = row["base_bytes_rank0"] <= row["base_bytes_total"] / WORLD + 64 * 14
                row.update(check=name, compute=compute, storage=storage,
                           ok=row["params4bit_kept"] and fits and (tol is None or (
                               row["max_loss_diff"] <= tol and row["max_adapter_diff"] <= tol)))
            except Exception as e:  # noqa: BLE001 - the row reports it; the other rows still run
                row = {"check": name, "ok": False, "error": error_text(e)}
            ok &= emit(row)
    try:
        row = _piece_quantize(dry)
    except Exception as e:  # noqa: BLE001 - reported as the row
        row = {"check": "qlora_piece_quantize", "ok": False, "error": error_text(e)}
    ok &= emit(row)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
