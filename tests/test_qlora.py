"""QLoRA: a 4-bit bitsandbytes base (``from_pretrained(quantization_config=...)``) with PEFT LoRA (and DoRA), sharded exactly.

The base is a tiny random Llama written by ``save_pretrained`` and loaded by transformers with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=float32)``
(bitsandbytes runs ``Linear4bit`` on CPU); LoRA on q/v/down. Every rank shards it (default wrap policy) and
trains on its own data; one process trains the same quantized model on the global batch. What must hold:

* every step's loss, two evaluation losses after training, and the trained adapters within 1e-5 of one process
  (fp32 compute), for
  ``bnb_4bit_quant_storage`` uint8 and bfloat16 (packed bytes that look like bf16 values);
* the packed bytes are sharded (each rank holds at most half of them plus row padding, together all of them),
  never changed, and ``fp.full_params`` shows real ``Params4bit`` objects with the original ``quant_state``;
* under ``MixedPrecision(param_dtype=bfloat16)`` a float32-stored packed weight reaches ``Linear4bit.forward``
  as the same bytes (a cast would rewrite every nibble);
* bitsandbytes 8-bit bases (``Linear8bitLt``: int8 rows, ``SCB`` row scales) the same way;
* layers that cannot be sharded exactly (trainable or unquantized 8-bit, 4-bit not quantized yet) and weights
  bitsandbytes already repacked in place are refused by name at ``fp.shard``; ``fp.load_pretrained`` of a 4-bit
  checkpoint or into 8-bit weights (full precision into 4-bit weights: ``test_qlora_deferred.py``).

The models are put in train mode as Trainer and Lightning do: in eval mode on AVX512-BF16 CPUs bitsandbytes
itself repacks the one-process reference's weights with bf16 scales (``_flat/packed.py``).
"""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _launch import run, torchrun
from _qlora import BATCH, SEQ, STEPS, WORLD, write_base
from _qlora import batch as _batch, build as _build, packed as _packed

import fsdp_plugin as fp

bnb = pytest.importorskip("bitsandbytes")
tf = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "hf_trainer_check.py"    # its "qlora" phase


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    return write_base(str(tmp_path_factory.mktemp("tiny_llama")))


def _scales(p):
    """What a quantized weight's values mean: 4-bit ``quant_state`` (absmax, code book), 8-bit row scales ``SCB``."""
    return p.quant_state if isinstance(p, bnb.nn.Params4bit) else p.SCB


def _adapters(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items() if "lora_" in k}


def _one_process(path: str, storage: torch.dtype, dora: bool):
    model = _build(path, storage, dora=dora)
    packed = {n: p.detach().view(torch.uint8).clone() for n, p in _packed(model).items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for s in range(STEPS):
        x = torch.cat([_batch(s, r) for r in range(WORLD)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    _cpu_inference_path(model, False)    # the kernel a GPU (and a sharded model) runs
    return losses + _evaluate(model, torch.cat([_batch(STEPS, r) for r in range(WORLD)])), \
        _adapters(model.state_dict()), packed


def _cpu_inference_path(model, on: bool) -> None:
    """bitsandbytes' in-place repacking for CPU inference (eval mode, no grad), as on an AVX512-BF16 CPU."""
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = on


def _evaluate(model, x: torch.Tensor, reduce=float) -> list:
    """Two eval-mode losses: the repacking would rewrite the shared quant_state at the first, so a sharded
    model whose master bytes kept the old layout would compute garbage at the second."""
    model.eval()
    with torch.no_grad():
        out = [reduce(model(input_ids=x, labels=x).loss) for _ in range(2)]
    model.train()
    return out


def _global_mean(loss: torch.Tensor, world: int) -> float:
    import torch.distributed as dist

    t = loss.detach().clone()
    dist.all_reduce(t)
    return t.item() / world


def _sharded(rank, world, path, storage, dora):
    model = _build(path, storage, dora=dora)
    states = {n: _scales(p) for n, p in _packed(model).items()}
    _cpu_inference_path(model, True)     # fp.shard must turn it off: it cannot rewrite a shard in place
    fp.shard(model)
    packed = _packed(model)
    assert packed.keys() == states.keys(), "fp.shard changed the class of a 4-bit weight"
    local = {n: p.numel() * p.element_size() for n, p in packed.items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for s in range(STEPS):
        x = _batch(s, rank)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(_global_mean(loss, world))
    losses += _evaluate(model, _batch(STEPS, rank), lambda loss: _global_mean(loss, world))
    held = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear8bitLt)
            and m.state.CB is not None and m.state.CB.untyped_storage().nbytes()]
    assert not held, f"8-bit layers keep their gathered rows between steps: {held}"
    with fp.full_params(model, writeback=False):
        full = _packed(model)
        kept = {n: (type(p).__name__, _scales(p) is states[n], tuple(p.shape)) for n, p in full.items()}
        nbytes = {n: p.detach().view(torch.uint8).clone() for n, p in full.items()}
    return losses, _adapters(fp.full_state_dict(model)), local, kept, nbytes


@pytest.mark.parametrize("storage,dora", [(torch.uint8, False), (torch.bfloat16, False), (torch.uint8, True),
                                          (torch.int8, False)], ids=["uint8", "bf16", "uint8-dora", "int8"])
def test_qlora_matches_one_process(base_dir, storage, dora):
    """DoRA also dequantizes the 4-bit base itself (its weight norm) through ``quant_state``. ``int8``: the base in
    bitsandbytes 8-bit (``Linear8bitLt``, int8 rows with their ``SCB`` row scales), whose backward reads the rows
    bitsandbytes keeps in the layer's ``state``: the gathered rows, released with them."""
    want_losses, want_adapters, want_bytes = _one_process(base_dir, storage, dora)
    got = run_ranks(_sharded, WORLD, base_dir, storage, dora, timeout=240)
    assert len(want_bytes) == 14   # 2 layers x 7 projections: every linear of the decoder is quantized
    cls_name = "Int8Params" if storage == torch.int8 else "Params4bit"
    for rank, (losses, adapters, local, kept, nbytes) in enumerate(got):
        diff = max(abs(a - b) for a, b in zip(losses, want_losses))
        assert diff <= TOL, f"rank {rank}: loss drift {diff:.2e}\n got {losses}\nwant {want_losses}"
        assert kept.keys() == want_bytes.keys()
        for n, (cls, same_state, shape) in kept.items():
            assert cls == cls_name and same_state, f"{n}: {cls}, quant_state kept: {same_state}"
            assert torch.equal(nbytes[n], want_bytes[n]), f"{n}: packed bytes changed"
    adapters = got[0][1]
    assert adapters.keys() == want_adapters.keys() and len(adapters) == (18 if dora else 12)
    for k, v in want_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= TOL, k
    # the packed base is sharded: each rank holds about half of its bytes, together all of them
    total = sum(b.numel() for b in want_bytes.values())
    per_rank = [sum(r[2].values()) for r in got]
    assert sum(per_rank) == total and max(per_rank) <= total / WORLD + 64 * 14, (per_rank, total)


def _bf16_run(rank, world, path, sharded):
    """The docs' bf16 recipe (``bnb_4bit_compute_dtype`` and the model's dtype bf16, bf16 storage, LoRA) for 4 AdamW
    steps and two evaluations: sharded (rank ``rank``'s batches) or in one process (the global batch). Returns the
    (global) losses and the step-0 logits."""
    model = _build(path, torch.bfloat16, compute=torch.bfloat16, dtype=torch.bfloat16)
    if sharded:
        fp.shard(model)
    else:
        _cpu_inference_path(model, False)    # the kernel a GPU (and a sharded model) runs
    rows = [rank] if sharded else range(WORLD)
    reduce = (lambda loss: _global_mean(loss, world)) if sharded else float
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, logits = [], None
    for s in range(STEPS):
        x = torch.cat([_batch(s, r) for r in rows])
        out = model(input_ids=x, labels=x)
        logits = out.logits.detach().clone() if s == 0 else logits
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        losses.append(reduce(out.loss))
    return losses + _evaluate(model, torch.cat([_batch(STEPS, r) for r in rows]), reduce), logits


def test_qlora_bf16_compute_within_derived_bound(base_dir):
    """bf16 compute: where a difference from one process can come from, and its bound. Each op (bitsandbytes' bf16
    kernel included) computes a sequence's rows alone, so at equal weights a rank's logits are bitwise the one-process
    logits of its rows (tested at step 0: bound 0). What differs is summation order, in fp32: the loss is the fp32
    mean of N = W*B*(S-1) = 28 token losses (one sum of N vs W sums, all-reduced): |dL| <= 2*N*2^-24*L (gamma_N on
    each side), 1.5e-5 at L = 4.6. LoRA gradients are fp32 sums over those N tokens (PEFT keeps adapters in fp32);
    AdamW passes them on as weight differences below 1e-6. bf16's roundoff 2^-8 enters only where such a difference
    moves a bf16 rounding across a boundary (one value jumps by 2^-7 relative): rare, not bounded a priori."""
    want, want_logits = _bf16_run(0, 1, base_dir, False)
    assert want_logits.dtype == torch.bfloat16
    bound = 2 * WORLD * BATCH * (SEQ - 1) * 2.0 ** -24 * max(want)
    for rank, (losses, logits) in enumerate(run_ranks(_bf16_run, WORLD, base_dir, True, timeout=240)):
        assert torch.equal(logits, want_logits[rank * BATCH:(rank + 1) * BATCH]), f"rank {rank}: step-0 logits differ"
        diff = max(abs(a - b) for a, b in zip(losses, want))
        assert diff <= bound, f"rank {rank}: {diff:.2e} > {bound:.2e}\n got {losses}\nwant {want}"


def _mixed_precision_worker(rank, world, path, storage):
    model = _build(path, storage, lora=False)
    want = {n: (p.detach().view(torch.uint8).clone(), _scales(p)) for n, p in _packed(model).items()}
    seen = {}

    def record(name):
        def hook(module, args):
            w = module.weight
            seen[name] = (type(w).__name__, w.dtype, torch.equal(w.detach().view(torch.uint8), want[name][0]),
                          _scales(w) is want[name][1])
        return hook

    for n, m in model.named_modules():
        if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            m.register_forward_pre_hook(record(n + ".weight"))
    fp.shard(model, mixed_precision=fp.MixedPrecision(param_dtype=torch.bfloat16))
    x = _batch(0, rank)
    model(input_ids=x, labels=x).loss.backward()
    return seen


@pytest.mark.parametrize("storage", [torch.float32, torch.int8], ids=["4bit-fp32-storage", "int8"])
def test_packed_bytes_reach_forward_uncast_under_mixed_precision(base_dir, storage):
    """float32 storage under bf16 mixed precision: every 4-bit layer's forward sees its own bytes in float32,
    as a Params4bit with its quant_state; an 8-bit layer its int8 rows as an Int8Params with its SCB."""
    cls_name = "Int8Params" if storage == torch.int8 else "Params4bit"
    for seen in run_ranks(_mixed_precision_worker, WORLD, base_dir, storage, timeout=240):
        assert len(seen) == 14
        for n, (cls, dtype, same, state) in seen.items():
            assert (cls, dtype, same, state) == (cls_name, storage, True, True), (n, cls, dtype, same, state)


def _refused_worker(rank, world, what, path):
    if what.startswith("int8"):     # trainable float weights, or frozen ones never quantized (never moved)
        layer = bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=what == "int8_fp16")
        model = torch.nn.Sequential(layer, torch.nn.Linear(64, 4))
    else:   # a 4-bit model that bitsandbytes repacked in place for CPU inference before fp.shard
        model = _build(path, torch.uint8, lora=False).eval()
        for m in model.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.support_avx512bf16_for_cpu = True    # the CPU path, whatever this CPU supports
        with torch.no_grad():
            model(input_ids=_batch(0, 0))
    with pytest.raises(fp.ShardingError) as err:
        fp.shard(model)
    return str(err.value)


def test_int8_layers_that_cannot_be_sharded_exactly_refused_by_name(base_dir):
    """8-bit layers are sharded (``test_qlora_matches_one_process[int8]``) once quantized and frozen; trainable
    ``has_fp16_weights`` ones (quantized again at every forward) and ones never quantized are refused."""
    msg = run_ranks(_refused_worker, 1, "int8_fp16", base_dir)[0]
    assert "0.weight" in msg and "has_fp16_weights=True" in msg and "load_in_8bit=True" in msg, msg
    msg = run_ranks(_refused_worker, 1, "int8_unquantized", base_dir)[0]
    assert "0.weight" in msg and "not quantized yet" in msg and "model.to(device)" in msg, msg


def test_weights_repacked_for_cpu_inference_refused(base_dir):
    msg = run_ranks(_refused_worker, 1, "repacked", base_dir)[0]
    assert "model.layers.0.self_attn.q_proj.weight" in msg and "call fp.shard before" in msg, msg


def _unquantized_worker(rank, world):
    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32), torch.nn.Linear(64, 4))
    with pytest.raises(fp.ShardingError) as err:
        fp.shard(model)
    return str(err.value)


def test_unquantized_4bit_layers_refused_with_the_alternative():
    """A ``Linear4bit`` never moved to a device (so never quantized) would be sharded as if its full-precision values
    were packed bytes (then fail inside bitsandbytes' forward): refused at ``fp.shard``, naming the ways that work.
    (One built under ``fp.deferred_init()`` is quantized by the engine: ``test_qlora_deferred.py``.)"""
    eager = run_ranks(_unquantized_worker, 1)[0]
    assert "bnb_quantized=False" in eager and "model.to(device)" in eager, eager
    assert "fp.deferred_init()" in eager and "quantization_config" in eager, eager


def _load_pretrained_worker(rank, world, path, path4, path8):
    """fp.load_pretrained of a checkpoint saved in 4-bit (or 8-bit) into a deferred model, and of any checkpoint into
    a sharded 8-bit model: refused. Then what the messages name: the 4-bit checkpoint through from_pretrained."""
    refused = []
    for saved in (path4, path8):
        with fp.deferred_init():
            model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(path))
        fp.shard(model)
        with pytest.raises(fp.ShardingError) as err:
            fp.load_pretrained(model, saved, strict=False)   # strict=False: no name check would stop it first
        refused.append(str(err.value))
    model = _build(path, torch.int8, lora=False)
    fp.shard(model)
    with pytest.raises(fp.ShardingError) as packed:
        fp.load_pretrained(model, path)     # into 8-bit weights (4-bit ones are quantized: test_qlora_deferred.py)
    model = tf.LlamaForCausalLM.from_pretrained(path4, dtype=torch.float32).train()   # quantization_config: saved
    fp.shard(model)
    x = _batch(0, rank)
    return refused, str(packed.value), _global_mean(model(input_ids=x, labels=x).loss, world)


def test_load_pretrained_of_4bit_refused_with_the_alternative(base_dir, tmp_path):
    """``fp.load_pretrained`` cannot read a 4-bit checkpoint's ``quant_state`` (it quantizes full-precision
    checkpoints only) nor load 8-bit weights: refused by name, never loaded as bytes beside the wrong scales. The alternative the
    message names, transformers' ``from_pretrained`` of the 4-bit checkpoint then ``fp.shard``, gives the
    one-process loss of the model it was saved from."""
    _build(base_dir, torch.int8, lora=False).save_pretrained(tmp_path / "int8")
    one = _build(base_dir, torch.uint8, lora=False)
    one.save_pretrained(tmp_path)
    _cpu_inference_path(one, False)
    x = torch.cat([_batch(0, r) for r in range(WORLD)])
    want = one(input_ids=x, labels=x).loss.item()
    (nf4, int8), packed, loss = run_ranks(_load_pretrained_worker, WORLD, base_dir, str(tmp_path),
                                          str(tmp_path / "int8"), timeout=240)[0]
    assert "holds a bitsandbytes-quantized checkpoint" in nf4 and "weight.quant_state.bitsandbytes__nf4" in nf4, nf4
    assert "then fp.shard(model)" in nf4, nf4
    assert "holds a bitsandbytes-quantized checkpoint" in int8 and "weight_format" in int8, int8
    assert "model.layers.0.self_attn.q_proj.weight" in packed and "load_in_8bit=True" in packed, packed
    assert abs(loss - want) <= TOL, (loss, want)


def _torchao_worker(rank, world):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4   # torchao 0.18's home of NF4

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 4))
    model[0].weight = torch.nn.Parameter(to_nf4(model[0].weight.detach(), 64, 64), requires_grad=False)
    x = torch.randn(3, 64)
    want, data = model(x).detach(), model[0].weight.quantized_data.clone()
    fp.shard(model)
    got = model(x).detach()
    with fp.full_params(model, writeback=False):
        w = model[0].weight
        kept = (type(w).__name__, torch.equal(w.quantized_data, data))
    return torch.equal(got, want), kept


def test_torchao_nf4_in_a_plain_linear_sharded_exactly():
    """torchao's ``NF4Tensor`` as the weight of a plain ``nn.Linear`` (torchao's ``F.linear`` override): sharded as
    its inner tensors' bytes (it was refused by name; before that it crashed inside torchao's ``aten.slice`` on one
    rank while the other waited). The same output as unsharded, bit for bit; ``fp.full_params`` shows the
    NF4Tensor. Training, mixed precision, exports and refusals: ``tests/test_qlora_torchao.py``."""
    try:    # torchao 0.18 is pinned for torch 2.13 (.ci/run); other lanes' torch may not import it
        importlib.import_module("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    except Exception as e:   # noqa: BLE001 - ImportError, or torchao's own version checks
        pytest.skip(f"torchao's NF4 does not import here: {e}")
    for same, kept in run_ranks(_torchao_worker, WORLD):
        assert same and kept == ("NF4Tensor", True), (same, kept)


_TRANSFORMERS_INTEGRATION = "fsdp_plugin.integrations.transformers"


def _without_transformers_integration() -> None:
    """A forked rank inherits the pytest process's modules: an earlier test in this worker may have installed the
    transformers integration (its ``save_pretrained`` patch included). Undo that and make any later import fail,
    so the save below is PEFT's own method on the engine's wrapper alone."""
    import sys

    installed = sys.modules.get(_TRANSFORMERS_INTEGRATION)
    if installed is not None:
        installed.uninstall()
    for name in list(sys.modules):
        if name == _TRANSFORMERS_INTEGRATION or name.startswith(_TRANSFORMERS_INTEGRATION + "."):
            del sys.modules[name]
    sys.modules[_TRANSFORMERS_INTEGRATION] = None     # ``import`` of it now raises ImportError


def _peft_save_worker(rank, world, path, out):
    import fsdp_plugin.integrations._ranged_save as ranged

    _without_transformers_integration()

    def no_gather(*args, **kwargs):
        raise AssertionError("model.save_pretrained gathered the model to rank 0")

    ranged.write_on_rank0 = no_gather      # the fallback that gathers: must not be taken
    model = _build(path, torch.bfloat16)
    fp.shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for s in range(2):
        x = _batch(s, rank)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)          # PEFT's own method; fsdp_plugin.integrations.transformers not imported
    with pytest.raises(fp.StateDictError, match="get_peft_model_state_dict"):
        peft.get_peft_model_state_dict(model)
    with fp.full_params(model, writeback=False):
        in_block = peft.get_peft_model_state_dict(model)
    return _adapters(fp.full_state_dict(model)), {k: v.clone() for k, v in in_block.items()}


def test_peft_save_pretrained_on_sharded_model_writes_adapters(base_dir, tmp_path):
    """``PeftModel.save_pretrained(dir)`` on a sharded QLoRA model: PEFT's adapter files, each rank writing its own
    byte ranges, loadable by ``PeftModel.from_pretrained`` onto a fresh 4-bit base with the trained values."""
    trained, in_block = run_ranks(_peft_save_worker, WORLD, base_dir, str(tmp_path), timeout=240)[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "adapter_config.json",
                                                          "adapter_model.safetensors"]
    base = tf.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32, quantization_config=tf.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_quant_storage=torch.bfloat16))
    loaded = _adapters(peft.PeftModel.from_pretrained(base, str(tmp_path)).state_dict())
    assert len(loaded) == len(trained) == 12
    for k, v in trained.items():
        assert torch.equal(loaded[k], v), k
    # inside fp.full_params PEFT's own state-dict helper sees the full adapters (PEFT drops the adapter name)
    assert {k: v for k, v in in_block.items()}.keys() == {k.replace(".default", "") for k in trained}
    assert all(torch.equal(in_block[k.replace(".default", "")], v) for k, v in trained.items())


_PROMPTS, _NEW = {0: [5, 17, 3, 42, 8], 1: [9, 60, 2]}, {0: 3, 1: 7}


def _greedy(model, rank: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([_PROMPTS[rank]]), max_new_tokens=_NEW[rank], do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0].tolist()


def _generate_worker(rank, world, path):
    model = _build(path, torch.uint8)
    fp.shard(model, timeout_s=60)
    return _greedy(model.eval(), rank)


def test_qlora_generate_per_rank_lengths(base_dir):
    """PEFT's ``generate`` on the sharded 4-bit model, prompts and lengths differing per rank (tests/test_generate.py
    covers the mechanism): the unsharded model's tokens."""
    model = _build(base_dir, torch.uint8).eval()
    _cpu_inference_path(model, False)     # the kernel the sharded layers run
    want = [_greedy(model, r) for r in range(WORLD)]
    assert run_ranks(_generate_worker, WORLD, base_dir, timeout=240) == want


def _checkpoint_worker(rank, world, path, ckpt, storage):
    model = _build(path, storage)
    fp.shard(model)
    with fp.full_params(model, writeback=False):
        want = {n: p.detach().view(torch.uint8).clone() for n, p in _packed(model).items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = _batch(0, rank)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    fp.save_checkpoint(ckpt, model, opt)
    other = _build(path, storage)
    fp.shard(other)
    with torch.no_grad():
        for p in _packed(other).values():
            p.view(torch.uint8).fill_(0xFF)     # bf16 NaN bit patterns: a canonicalizing copy would change them
    fp.load_checkpoint(ckpt, other)
    with fp.full_params(other, writeback=False):
        got = {n: p.detach().view(torch.uint8).clone() for n, p in _packed(other).items()}
    return all(torch.equal(got[n], want[n]) for n in want), len(want)


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_sharded_checkpoint_round_trips_packed_bytes(base_dir, tmp_path, storage):
    """``fp.save_checkpoint`` / ``fp.load_checkpoint`` (what the Trainer's and Lightning's checkpoints use) restore
    the packed bf16-stored bytes (and 8-bit int8 rows) bit for bit."""
    got = run_ranks(_checkpoint_worker, WORLD, base_dir, str(tmp_path / "ckpt"), storage, timeout=240)
    assert got == [(True, 14)] * 2


def _state_dict_worker(rank, world, path, storage):
    model = _build(path, storage, lora=False)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fp.shard(model)
    got = fp.full_state_dict(model)
    if rank:
        return None
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return [k for k in want if not (got[k].dtype == want[k].dtype and torch.equal(
        got[k].view(torch.uint8) if got[k].dtype == torch.bfloat16 else got[k],
        want[k].view(torch.uint8) if want[k].dtype == torch.bfloat16 else want[k]))]


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.int8], ids=["bf16", "int8"])
def test_full_state_dict_equals_the_plain_state_dict(base_dir, storage):
    """``fp.full_state_dict`` promises the plain model's ``state_dict()``: for a 4-bit model that includes the
    ``quant_state`` entries bitsandbytes writes (absmax, quant_map, ...), for an 8-bit one ``SCB`` and
    ``weight_format``, and the packed bytes unchanged."""
    assert run_ranks(_state_dict_worker, WORLD, base_dir, storage, timeout=240)[0] == []


@pytest.mark.integration   # two Trainer launches (one process, then torchrun at 2): ~14 s
def test_qlora_trainer_sharded_matches_one_process(tmp_path):
    """The FSDP-QLoRA recipe of accelerate's and PEFT's docs with our line: a 4-bit nf4 base (bf16 storage) from
    ``from_pretrained(quantization_config=...)``, LoRA, ``TrainingArguments(fsdp=True)`` under torchrun. Loss and
    gradient norm per step within 1e-5 of the same Trainer in one process; each rank holds half of the packed
    bytes; PEFT's ``save_pretrained`` writes the adapter files."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    assert "HF_TRAINER_CHECK_DONE" in run([sys.executable, str(SCRIPT), one, "qlora"], timeout=240, cwd=ROOT)
    assert "HF_TRAINER_CHECK_DONE" in run(torchrun("--standalone", "--nproc_per_node=2", SCRIPT, two, "qlora"),
                                          timeout=240, cwd=ROOT)
    ref, got = report(one, "qlora"), [report(two, "qlora", r) for r in range(2)]
    assert not ref["sharded"] and all(g["sharded"] for g in got)
    close(got[0]["hist"]["loss"], ref["hist"]["loss"])
    close(got[0]["hist"]["grad_norm"], ref["hist"]["grad_norm"])
    assert all(g["params4bit"] == ref["params4bit"] == 14 for g in got)
    assert sum(g["packed_bytes"] for g in got) == ref["packed_bytes"] and got[0]["packed_bytes"] < ref["packed_bytes"]
    assert got[0]["files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"]


def report(out: Path, phase: str, rank: int = 0) -> dict:
    return json.loads((out / f"{phase}_rank{rank}.json").read_text())


def close(a: list, b: list, tol: float = TOL) -> None:
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol, (a, b)


def _one_process_recipe(path: str, storage: torch.dtype) -> tuple[list, int]:
    """The training losses of ``_one_process`` and the total packed bytes of the base (every rank's share added)."""
    losses, _, packed = _one_process(path, storage, False)
    return losses[:STEPS], sum(b.numel() for b in packed.values())


def _check_recipe(reports: list, want: list, total: int) -> None:
    """Every rank: the one-process losses within 1e-5 (fp32 compute); after training ``fp.full_params`` shows 14
    ``Params4bit`` with their ``quant_state`` and all the packed bytes; each rank holds half of them (plus row
    padding), together all of them."""
    for rank, rep in enumerate(reports):
        close(rep["losses"], want)
        assert rep["sharded"] and (rep["full_params4bit"], rep["full_bytes"]) == (14, total), (rank, rep)
    per_rank = [rep["packed_bytes"] for rep in reports]
    assert sum(per_rank) == total and max(per_rank) <= total / WORLD + 64 * 14, (per_rank, total)


@pytest.mark.integration   # Lightning's launcher at 2 (~12 s)
def test_qlora_lightning_recipe_matches_one_process(base_dir, tmp_path):
    """The FSDP-QLoRA recipe through ``L.Trainer(strategy="fsdp_plugin", devices=2)``: a LightningModule holding the
    4-bit nf4 base (uint8 storage) with PEFT LoRA, built before ``fit`` (``scripts/lightning_qlora.py``)."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import lightning_launch as launch

    pytest.importorskip("lightning")
    launch.python("lightning_qlora.py", base_dir, tmp_path, "--devices", WORLD, timeout=240)
    _check_lightning(tmp_path, base_dir)


@pytest.mark.integration   # Lightning's launcher at 2 (~12 s)
def test_qlora_lightning_deferred_skeleton_matches_one_process(base_dir, tmp_path):
    """The 70B path through Lightning: the 4-bit skeleton + LoRA built in ``configure_model`` (under
    ``fp.deferred_init()``), ``fp.load_pretrained`` of the full-precision base in ``on_fit_start`` (each rank
    quantizes its piece): the same losses and packed bytes as ``from_pretrained(quantization_config=...)``."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import lightning_launch as launch

    pytest.importorskip("lightning")
    launch.python("lightning_qlora.py", base_dir, tmp_path, "--devices", WORLD, "--deferred", timeout=240)
    _check_lightning(tmp_path, base_dir)


def _check_lightning(tmp_path, base_dir) -> None:
    reports = [report(tmp_path, "lightning", r) for r in range(WORLD)]
    assert all(r["strategy"] == "FSDPPluginStrategy" and r["world_size"] == WORLD for r in reports)
    _check_recipe(reports, *_one_process_recipe(base_dir, torch.uint8))


_ACCELERATE_ENV = {   # what `accelerate launch --config_file` exports for the FSDP-QLoRA doc's config (fp32 here)
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
    "FSDP_SYNC_MODULE_STATES": "false", "ACCELERATE_MIXED_PRECISION": "no"}


def _accelerate_worker(rank, world, path):
    import os

    os.environ.update(_ACCELERATE_ENV)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)    # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations.accelerate import Accelerator
    from _qlora import packed_facts

    import warnings

    acc = Accelerator()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = _build(path, torch.bfloat16)   # the docs' cpu_ram_efficient_loading: every rank loads it (quantized)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = acc.prepare(model, opt)
    losses = []
    for s in range(STEPS):
        x = _batch(s, rank)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    warned = sum("quantized model loads on every rank" in str(w.message) for w in seen)
    return {"losses": losses, "sharded": fp.is_sharded(model), "warned": warned, **packed_facts(model)}


def test_qlora_accelerate_recipe_matches_one_process(base_dir):
    """The FSDP-QLoRA recipe through the Accelerate plug-in (``fsdp_plugin.integrations.accelerate.Accelerator``,
    the env ``accelerate launch`` exports for an FSDP2 transformer-wrap config) on 2 forked ranks: a 4-bit nf4 base
    with bf16 storage (the docs' ``bnb_4bit_quant_storage``) and PEFT LoRA through ``prepare``/``backward``. The docs'
    ``fsdp_cpu_ram_efficient_loading: true`` cannot load a quantized base on rank 0 only (its scales are not tensors
    the engine scatters; ranks > 0 would hold unquantized meta weights): every rank loads it, rank 1 says so."""
    pytest.importorskip("accelerate")
    reports = run_ranks(_accelerate_worker, WORLD, base_dir, timeout=240)
    assert [r["warned"] for r in reports] == [0, 1], reports
    _check_recipe(reports, *_one_process_recipe(base_dir, torch.bfloat16))
