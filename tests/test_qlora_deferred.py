"""The 70B QLoRA path: a 4-bit skeleton built under ``fp.deferred_init()``, ``fp.shard``, then ``fp.load_pretrained``
of the full-precision checkpoint, each rank reading and quantizing only its own piece.

What must hold:

* quantizing block-aligned pieces at the engine's (unaligned) shard boundaries gives bitsandbytes' bytes and
  ``quant_state`` of the whole weight, bit for bit (nf4/fp4, double quantization on/off, uint8/bf16 storage), and
  quantizing from the unaligned boundary instead does not (so the check can fail);
* ``fp.shard`` of the deferred skeleton equals eager construction quantized by ``model.to(device)``;
* at world 2, skeleton + LoRA under ``fp.deferred_init()`` then ``fp.load_pretrained``: packed bytes and
  ``quant_state`` equal ``from_pretrained(quantization_config=...)``'s, and losses and adapters after 4 AdamW steps
  equal that model trained in one process within 1e-5 (fp32 compute); each rank reads about half of the base's
  full-precision bytes;
* README's recipe (``from_config`` in bf16, double quantization, bf16 storage) gives ``from_pretrained``'s bytes and
  ``quant_state`` (dtype bf16 included);
* an 8-bit skeleton built under ``fp.deferred_init()`` is refused by name.
"""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks
from _qlora import STEPS, WORLD, add_lora, batch, write_base

import fsdp_plugin as fp
from fsdp_plugin._flat import packed_quantize

bnb = pytest.importorskip("bitsandbytes")
tf = pytest.importorskip("transformers")
pytest.importorskip("peft")

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

TOL = 1e-5


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    return write_base(str(tmp_path_factory.mktemp("tiny_llama")))


def _pieces(total: int, cuts: list) -> list:
    bounds = [0, *cuts, total]
    return list(zip(bounds[:-1], bounds[1:]))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16"])
def test_piece_quantization_is_bit_identical_to_the_whole(quant_type, double, storage):
    torch.manual_seed(0)
    shape = (37, 50) if storage == torch.uint8 else (36, 50)   # a partial last block; odd bytes where uint8 allows
    w = torch.randn(shape) * torch.linspace(0.1, 3, shape[0]).unsqueeze(1)
    w[3] = 0     # all-zero blocks: absmax 0
    want, want_state = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=double,
                                                    quant_type=quant_type, quant_storage=storage)
    p = bnb.nn.Params4bit(w.clone(), requires_grad=False, blocksize=64, compress_statistics=double,
                          quant_type=quant_type, quant_storage=storage).to("cpu")
    total = p.numel()
    got = torch.zeros(total * p.element_size(), dtype=torch.uint8)
    absmax = torch.zeros(want_state.shape.numel() // 64 + 1)
    flat = w.reshape(-1)
    for start, end in _pieces(total, [total // 3 + 1, total // 3 + 7, 2 * total // 3 - 5]):   # unaligned cuts
        lo, hi = packed_quantize.piece_values(start, end, p.element_size(), flat.numel(), 64)
        own, piece = packed_quantize.quantize_piece(p, flat[lo:hi].clone(), lo, start, end)
        got[start * p.element_size():end * p.element_size()] = own
        absmax[lo // 64:lo // 64 + piece.numel()] = piece
    state = packed_quantize.whole_state(p, absmax)
    assert torch.equal(got, want.view(-1).view(torch.uint8))
    assert state.shape == want_state.shape and state.dtype == want_state.dtype
    assert torch.equal(state.absmax, want_state.absmax) and torch.equal(state.code, want_state.code)
    if double:
        assert torch.equal(state.offset, want_state.offset)
        assert torch.equal(state.state2.absmax, want_state.state2.absmax)
        assert torch.equal(state.state2.code, want_state.state2.code)
    else:
        assert state.state2 is None
    # the check can fail: a piece quantized from its own (unaligned) first value is not the whole's bytes
    start = total // 3 + 1
    v0 = 2 * start * p.element_size()
    wrong, _ = packed_quantize.quantize_piece(p, flat[v0:].clone(), v0, start, total)
    assert not torch.equal(wrong, got[start * p.element_size():])


def _skeleton(path: str, quant, lora: bool):
    with fp.deferred_init():
        model = tf.LlamaForCausalLM(tf.LlamaConfig.from_pretrained(path))
        model = tf.integrations.replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"],
                                                        quantization_config=quant)
        if lora:
            model = add_lora(model)
    return model.train()


def _quant(storage: torch.dtype, quant_type: str, double: bool):
    return tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                                 bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)


def _packed(model) -> dict:
    """The 4-bit weights by their base model's name: bytes, and the quant_state tensors bitsandbytes saves."""
    out = {}
    for n, p in model.named_parameters():
        if isinstance(p, bnb.nn.Params4bit):
            state = {k: v.clone() for k, v in p.quant_state.as_dict(packed=True).items()}
            out[n.replace("base_model.model.", "").replace(".base_layer", "")] = (p.detach().view(torch.uint8).clone(),
                                                                                  state)
    return out


def _load_counting(model, path: str) -> int:
    """``fp.load_pretrained(model, path)`` (strict); returns the checkpoint bytes this rank read for 4-bit weights."""
    from fsdp_plugin.checkpoint.format.reader import ReadPlan

    read, add = [0], ReadPlan.add

    def counting(self, f, offset, src, dest, name):
        if "proj" in name:     # the 4-bit weights: every decoder projection
            read[0] += dest.numel() * src.itemsize
        return add(self, f, offset, src, dest, name)
    ReadPlan.add = counting
    try:
        assert not fp.load_pretrained(model, path)   # strict: every base weight found, adapters not asked for
    finally:
        ReadPlan.add = add
    return read[0]


def _deferred_worker(rank, world, path, quant_args):
    model = _skeleton(path, _quant(*quant_args), lora=True)
    fp.shard(model)
    read = [_load_counting(model, path)]
    with fp.full_params(model, writeback=False):
        packed = _packed(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for s in range(STEPS):
        x = batch(s, rank)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    adapters = {k: v.clone() for k, v in fp.full_state_dict(model).items() if "lora_" in k}
    return losses, adapters, packed, read[0]


def _one_process(path: str, quant):
    model = tf.LlamaForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32)
    packed = _packed(model)
    model = add_lora(model).train()
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False   # the kernel a GPU (and a sharded model) runs
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for s in range(STEPS):
        x = torch.cat([batch(s, r) for r in range(WORLD)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}, packed


@pytest.mark.parametrize("quant_args", [(torch.uint8, "nf4", False), (torch.bfloat16, "nf4", True)],
                         ids=["nf4-uint8", "nf4-bf16-double"])
def test_deferred_4bit_load_matches_from_pretrained(base_dir, quant_args):
    """Bytes and quant_state equal from_pretrained's; training equals one process; each rank reads ~half."""
    want_losses, want_adapters, want_packed = _one_process(base_dir, _quant(*quant_args))
    got = run_ranks(_deferred_worker, WORLD, base_dir, quant_args, timeout=240)
    assert len(want_packed) == 14
    for rank, (losses, _, packed, _) in enumerate(got):
        assert packed.keys() == want_packed.keys()
        for n, (data, state) in packed.items():
            want_data, want_state = want_packed[n]
            assert torch.equal(data, want_data), f"rank {rank} {n}: packed bytes differ"
            assert state.keys() == want_state.keys(), (state.keys(), want_state.keys())
            for k, v in want_state.items():
                assert torch.equal(state[k], v), f"rank {rank} {n}.{k} differs"
        diff = max(abs(a - b) for a, b in zip(losses, want_losses))
        assert diff <= TOL, f"rank {rank}: loss drift {diff:.2e}\n got {losses}\nwant {want_losses}"
    adapters = got[0][1]    # fp.full_state_dict: rank 0's
    assert adapters.keys() == want_adapters.keys() and len(adapters) == 12
    for k, v in want_adapters.items():
        assert (adapters[k] - v).abs().max().item() <= TOL, k
    # full-precision bytes read for the 4-bit weights: about 1/world each (boundary blocks read by both)
    total = sum(want_data.numel() * 2 * 4 for want_data, _ in want_packed.values())   # 2 values a byte, fp32
    read = [r[3] for r in got]
    assert sum(read) >= total and max(read) <= total / WORLD + 14 * 2 * 64 * 4, (read, total)


def _recipe_worker(rank, world, path):
    """README's recipe: from_config in bf16, replace_with_bnb_linear, .to(bf16), LoRA; double quant, bf16 storage."""
    q = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    with fp.deferred_init():
        model = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        model = tf.integrations.replace_with_bnb_linear(model, modules_to_not_convert=["lm_head"],
                                                        quantization_config=q)
        model = add_lora(model.to(torch.bfloat16))
    fp.shard(model)
    read = _load_counting(model, path)
    with fp.full_params(model, writeback=False):
        packed = _packed(model)
        dtypes = {n: p.quant_state.dtype for n, p in model.named_parameters() if isinstance(p, bnb.nn.Params4bit)}
    return packed, set(dtypes.values()), read


@pytest.fixture(scope="module")
def odd_base_dir(tmp_path_factory) -> str:
    """intermediate_size 65: a unit's packed bytes are 193.5 blocks a rank at world 2 (a boundary inside a block)."""
    path = str(tmp_path_factory.mktemp("odd_llama"))
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=65, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("odd", [False, True], ids=["aligned", "unaligned"])
def test_readme_recipe_bf16_double_quant_equals_from_pretrained(base_dir, odd_base_dir, odd):
    """``unaligned``: shard boundaries inside quantization blocks (both neighbours read the boundary block)."""
    base_dir = odd_base_dir if odd else base_dir
    q = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    want = _packed(tf.LlamaForCausalLM.from_pretrained(base_dir, quantization_config=q, dtype=torch.bfloat16))
    got = run_ranks(_recipe_worker, WORLD, base_dir, timeout=240)
    for packed, dtypes, _ in got:
        assert dtypes == {torch.bfloat16} and packed.keys() == want.keys() and len(want) == 14
        for n, (data, state) in packed.items():
            assert torch.equal(data, want[n][0]), n
            assert state.keys() == want[n][1].keys() and all(torch.equal(state[k], v) for k, v in want[n][1].items())
    total = sum(data.numel() * 2 * 4 for data, _ in want.values())    # 2 values a byte, fp32 in the checkpoint
    read = [r for *_, r in got]
    assert sum(read) >= total and max(read) <= total / WORLD + 14 * 2 * 64 * 4, (read, total)
    assert (sum(read) > total) == odd, (read, total)   # boundary blocks read by both neighbours


def _failing_read_worker(rank, world, path):
    from fsdp_plugin.checkpoint.hf import quantized

    model = _skeleton(path, _quant(torch.uint8, "nf4", False), lora=False)
    fp.shard(model)
    if rank == 1:
        def broken(*args):
            raise OSError("injected read failure")
        quantized._quantize_own = broken
    with pytest.raises(Exception) as err:
        fp.load_pretrained(model, path)
    return f"{type(err.value).__name__}: {err.value}"


def test_a_rank_failing_to_read_its_piece_fails_every_rank_at_once(base_dir):
    """The ranks agree before the absmax all-reduces: one rank's read error is raised on every rank (well inside
    run_ranks' 60 s), not a wait on a collective its peer never joins."""
    msgs = run_ranks(_failing_read_worker, WORLD, base_dir, timeout=60)
    assert "injected read failure" in msgs[1], msgs
    assert "injected read failure" in msgs[0] or "another rank failed" in msgs[0], msgs


def _eager_vs_deferred_worker(rank, world):
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="fp4",
                              compress_statistics=True, quant_storage=torch.bfloat16), torch.nn.Linear(64, 4))
    eager = build().to("cpu")        # bitsandbytes quantizes at .to()
    with fp.deferred_init():
        model = build()
    fp.shard(model)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(rank))
    with fp.full_params(model, writeback=False):
        w = model[0].weight
        same = (type(w).__name__, torch.equal(w.view(torch.uint8), eager[0].weight.view(torch.uint8)),
                torch.equal(w.quant_state.absmax, eager[0].weight.quant_state.absmax))
    return same, (model(x) - eager(x)).abs().max().item()


def test_deferred_4bit_skeleton_shards_as_eager_construction_quantized():
    for same, diff in run_ranks(_eager_vs_deferred_worker, WORLD):
        assert same == ("Params4bit", True, True) and diff == 0.0, (same, diff)


def _int8_worker(rank, world):
    with fp.deferred_init():
        model = torch.nn.Sequential(bnb.nn.Linear8bitLt(64, 64, has_fp16_weights=False), torch.nn.Linear(64, 4))
    with pytest.raises(fp.ShardingError) as err:
        fp.shard(model)
    return str(err.value)


def test_deferred_8bit_skeleton_refused_by_name():
    msg = run_ranks(_int8_worker, 1)[0]
    assert "0.weight" in msg and "deferred 4-bit weights only" in msg and "load_in_8bit=True" in msg, msg


_ACCELERATE_ENV = {   # what `accelerate launch --config_file` exports for an FSDP2 transformer-wrap config (fp32)
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer", "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT",
    "ACCELERATE_MIXED_PRECISION": "no"}


def _accelerate_worker(rank, world, path):
    """README's Accelerate recipe for the skeleton: ``acc.prepare(model)`` shards it, ``fp.load_pretrained`` loads,
    then the optimizer is built and prepared."""
    import os

    os.environ.update(_ACCELERATE_ENV)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)    # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations.accelerate import Accelerator

    acc = Accelerator()
    model = acc.prepare(_skeleton(path, _quant(torch.uint8, "nf4", False), lora=True))
    assert fp.is_sharded(model) and not fp.load_pretrained(model, path)
    with fp.full_params(model, writeback=False):
        packed = _packed(model)
    opt = acc.prepare(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2))
    losses = []
    for s in range(STEPS):
        x = batch(s, rank)
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(acc.reduce(loss.detach(), "mean").item())
    return losses, packed


def test_deferred_4bit_skeleton_through_the_accelerate_plugin(base_dir):
    pytest.importorskip("accelerate")
    want_losses, _, want_packed = _one_process(base_dir, _quant(torch.uint8, "nf4", False))
    for losses, packed in run_ranks(_accelerate_worker, WORLD, base_dir, timeout=240):
        assert packed.keys() == want_packed.keys() and len(packed) == 14
        assert all(torch.equal(packed[n][0], want_packed[n][0]) for n in packed)
        diff = max(abs(a - b) for a, b in zip(losses, want_losses))
        assert diff <= TOL, f"loss drift {diff:.2e}\n got {losses}\nwant {want_losses}"
