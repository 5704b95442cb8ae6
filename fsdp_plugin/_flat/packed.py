"""Packed quantized weights (bitsandbytes ``Params4bit``, ``Int8Params``): bytes that only look like a dtype.

A 4-bit weight is stored as packed nibbles in ``quant_storage`` (uint8, or bf16/fp16/fp32 *as bytes*), with its
scales in ``weight.quant_state`` (a Python attribute, not a parameter or buffer). The engine shards the packed
bytes like any frozen parameter, with three rules that keep them exact:

* **never converted**: a packed weight gets its own flat handle whose compute and reduce dtype are its storage
  dtype under every ``MixedPrecision`` and fp32 region, and whose collectives are never quantized (a cast or a
  rounding would rewrite nibbles; ``shard.group_params`` / ``shard.handle_dtypes``);
* **the class and ``quant_state`` survive**: forward views and ``fp.full_params`` tensors are the parameter's
  own class over the gathered bytes, with the original's attributes (``rewrap``), so ``Linear4bit.forward`` sees
  a real ``Params4bit`` with its ``quant_state``;
* **no in-place rewrite**: bitsandbytes' CPU inference path (eval mode, AVX512-BF16 CPUs) repacks
  ``weight.data`` and rewrites ``quant_state`` in place (absmax to bf16: lossy, one way). On a sharded model it
  would rewrite the shared ``quant_state`` while the master bytes stay in the old layout, so ``prepare``
  turns it off on every sharded 4-bit layer (bitsandbytes' own switch, ``support_avx512bf16_for_cpu``): those
  layers run bitsandbytes' standard kernel, as they do on a GPU.

8-bit weights (``Linear8bitLt``, frozen: ``has_fp16_weights=False``) follow the same rules: int8 rows sharded as
bytes, the row scales ``SCB`` (one fp32 per row) kept whole on the parameter; bitsandbytes moves CB/SCB into
``module.state`` at a forward and its backward reads ``state.CB``, so each gathered view carries its own CB
(``rewrap``) and the full rows' references are dropped before sharding (``_prepare_int8``).

``quant_state`` itself stays whole on every rank (one absmax per 64-value block: 4 bytes per 32 packed bytes,
about 1 with ``bnb_4bit_use_double_quant``). What the engine cannot shard exactly is refused by name (``prepare``):
trainable 8-bit weights, 4-bit weights not quantized yet (unless built under ``fp.deferred_init()``: the engine
quantizes those, ``packed_quantize.py``), weights already repacked, torchao tensor subclasses other than ``NF4Tensor``;
``fp.load_pretrained`` quantizes a full-precision checkpoint into 4-bit weights shard by shard, never reads a
quantized checkpoint or into 8-bit or NF4 weights (``refuse_load``).

torchao's ``NF4Tensor`` (torchtune's QLoRA, ``to_nf4`` + ``linear_nf4``) is a wrapper subclass with no storage of
its own: its values live in inner tensors (packed nibbles, int8 block scalers, their factors, the scaler mean and
the 16-entry nf4 table) that ``__tensor_flatten__`` names. ``prepare`` replaces it on its module by a frozen uint8
*carrier*, the byte concatenation of those inner tensors (widest dtype first, so every part starts aligned), with
the subclass's flatten context on it (``InnerBytes``); the carrier is sharded as packed bytes like ``Params4bit``
(each rank ~1/world of them, never cast), and ``rewrap`` rebuilds the NF4Tensor from the gathered bytes through the
subclass's own ``__tensor_unflatten__``: its inner tensors are views of the gathered buffer, byte for byte the
original's. Outside forward and ``fp.full_params`` the module holds the carrier's piece (uint8), as a sharded
``Params4bit`` holds its piece of nibbles.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..errors import ShardingError
from .. import _compat
from . import packed_quantize

_PACKED = {"Params4bit", "Int8Params"}     # bitsandbytes classes sharded exactly (their bytes, never cast)
_INNER = {"NF4Tensor"}     # torchao wrapper subclasses sharded exactly as their inner tensors' bytes (``InnerBytes``)


def _bnb_class(t) -> str | None:
    """The class name when ``t`` is a bitsandbytes parameter class (bitsandbytes is never imported here)."""
    for cls in type(t).__mro__:
        if cls.__module__.startswith("bitsandbytes."):
            return cls.__name__
    return None


def is_4bit(t) -> bool:
    """``t`` is a bitsandbytes 4-bit weight (``Params4bit``: packed, or pending under ``fp.deferred_init()``)."""
    return _bnb_class(t) == "Params4bit"


def is_8bit(t) -> bool:
    """``t`` is a bitsandbytes 8-bit weight (``Int8Params``)."""
    return _bnb_class(t) == "Int8Params"


def _torchao_class(t) -> str | None:
    """The class name when ``t`` is a torchao tensor subclass (``NF4Tensor``, ...; torchao is never imported here)."""
    for cls in type(t).__mro__:
        if cls.__module__.startswith("torchao."):
            return cls.__name__
    return None


class InnerBytes:
    """How a torchao wrapper subclass (``NF4Tensor``) sits in its carrier's bytes: the class (taken from the
    weight: torchao is never imported here), its ``__tensor_flatten__`` context and outer size/stride, and each
    inner tensor's ``(name, dtype, shape, first byte, bytes)``."""

    def __init__(self, t: torch.Tensor):
        names, self.ctx = t.__tensor_flatten__()
        inner = {n: getattr(t, n) for n in names}
        self.cls, self.size, self.stride = type(t), tuple(t.shape), tuple(t.stride())
        # widest elements first: each part then starts at a multiple of its element size (powers of two)
        order = sorted(names, key=lambda n: -inner[n].element_size())
        self.parts, pos = [], 0
        for n in order:
            nbytes = inner[n].numel() * inner[n].element_size()
            self.parts.append((n, inner[n].dtype, tuple(inner[n].shape), pos, nbytes))
            pos += nbytes
        self.nbytes = pos

    def payload(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s inner tensors as one flat uint8 tensor in this layout (a copy: the carrier's bytes)."""
        return torch.cat([_as_bytes(getattr(t, name)) for name, *_ in self.parts])

    def rebuild(self, view: torch.Tensor) -> torch.Tensor:
        """The subclass over ``view`` (the carrier's gathered bytes): inner tensors are views of it, no copy
        (a part whose first byte is not aligned for its dtype is copied: a few scalars, same bytes)."""
        view = view.detach().reshape(-1)
        inner = {}
        for name, dtype, shape, start, nbytes in self.parts:
            b = view[start:start + nbytes]
            if dtype.itemsize > 1 and b.storage_offset() % dtype.itemsize:
                b = b.clone()
            inner[name] = b.view(dtype).view(shape)
        ctx = {k: _on_device(v, view.device) for k, v in self.ctx.items()} if isinstance(self.ctx, dict) else self.ctx
        return self.cls.__tensor_unflatten__(inner, ctx, self.size, self.stride)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as flat bytes (a copy in row-major order: NF4's one-element ``quantization_factor`` has
    stride 256, which ``view(torch.uint8)`` refuses even though it is one element)."""
    return t.detach().new_empty(t.shape).copy_(t).reshape(-1).view(torch.uint8)


def _on_device(v, device):
    """A flatten-context entry (NF4's ``tensor_meta`` dataclass) moved to ``device`` and frozen: the rebuilt
    wrapper reports the device its inner tensors are on and never requires grad."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        names = {f.name for f in dataclasses.fields(v)}
        changes = {k: x for k, x in (("device", device), ("requires_grad", False)) if k in names}
        return dataclasses.replace(v, **changes) if changes else v
    return v


def inner_bytes(p) -> InnerBytes | None:
    """The layout when ``p`` is the uint8 carrier of a torchao weight (``prepare``), else None."""
    layout = getattr(p, "_fp_inner_bytes", None)
    return layout if isinstance(layout, InnerBytes) else None


def is_packed(p) -> bool:
    """``p`` holds packed quantized bytes that the engine shards as bytes (never cast, class kept): a bitsandbytes
    4/8-bit weight or the carrier of a torchao ``NF4Tensor``. An 8-bit weight with ``has_fp16_weights`` holds
    trainable float values instead (refused by ``prepare``)."""
    if inner_bytes(p) is not None:
        return True
    return _bnb_class(p) in _PACKED and not getattr(p, "has_fp16_weights", False)


def carrier_shape(p) -> tuple | None:
    """The ``(bytes,)`` shape of the uint8 carrier ``prepare`` will make of torchao weight ``p`` (an ``NF4Tensor``
    not prepared yet: what ``fp.plan`` counts), else None. Reads only the inner tensors' sizes (fake ones too)."""
    if _torchao_class(p) not in _INNER or not hasattr(p, "__tensor_flatten__"):
        return None
    names, _ = p.__tensor_flatten__()
    return (sum(getattr(p, n).numel() * getattr(p, n).element_size() for n in names),)


def keeps_class(p) -> bool:
    """``p``'s own class must survive a storage swap (bitsandbytes' parameters; a carrier is a plain Parameter)."""
    return is_packed(p) and inner_bytes(p) is None


def rewrap(original: nn.Parameter, view: torch.Tensor) -> torch.Tensor:
    """``view``'s storage as ``original``'s class with ``original``'s attributes (``quant_state``, ``blocksize``,
    ...): what ``Linear4bit.forward`` and ``fp.full_params`` must see. No copy: the storage is ``view``'s. For a
    torchao carrier: the ``NF4Tensor`` rebuilt over ``view`` (a frozen parameter, as torchtune registers it)."""
    layout = inner_bytes(original)
    if layout is not None:
        return nn.Parameter(layout.rebuild(view), requires_grad=False)
    out = _compat.make_subclass(type(original), view.detach(), False)
    out.__dict__.update({k: v for k, v in original.__dict__.items() if not k.startswith("_fp_")})
    if _bnb_class(original) == "Int8Params":
        # Linear8bitLt.forward moves weight.CB (the int8 rows) and SCB into its ``state`` at each forward where
        # weight.CB is set, and its backward reads state.CB: these gathered rows, which the engine gathers again
        # into the same storage for backward. The original's CB is dropped by ``prepare`` (it was the full rows).
        out.CB = view.detach()
    return out


def prepare(model: nn.Module, ignored_modules=()) -> int:
    """Check every quantized parameter before sharding and turn off in-place repacking (module doc).

    Refuses layer types that cannot be sharded exactly and 4-bit weights already repacked for CPU inference
    (an eval-mode forward ran before ``fp.shard``). Parameters of ``ignored_modules`` stay as they are (the engine
    never touches them: kept whole, they run bitsandbytes' own path). Returns the number of packed parameters."""
    count, int8, inner, pending = 0, [], {}, []
    ignored = {id(p) for m in ignored_modules for p in m.parameters()}
    for fqn, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in ignored:
                continue
            kind = _bnb_class(p)
            where = f"{fqn}.{name}" if fqn else name
            if _torchao_class(p):
                if id(p) not in inner:
                    _check_inner(where, p)
                inner.setdefault(id(p), (p, []))[1].append((module, name))
                continue
            if kind == "Int8Params":
                int8.append((module, p, _int8_scales(where, module, p)))
                continue
            if kind not in _PACKED:
                continue
            if kind == "Params4bit" and packed_quantize.pending(p):
                pending.append(p)      # quantized by the engine (``packed_quantize.py``), after every check
            elif getattr(p, "bnb_quantized", True) is False:
                raise ShardingError(_not_quantized(where, p))
            if getattr(getattr(p, "quant_state", None), "packing_format_for_cpu", False):
                raise ShardingError(
                    f"{where} was repacked by bitsandbytes' CPU inference path (the model ran a forward in eval "
                    "mode before fp.shard), which rewrote its bytes and quant_state in place: call fp.shard before "
                    "running the model, or load it again")
            count += 1
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    for p in pending:
        packed_quantize.defer(p)
    for module, p, scb in int8:     # after every check passed: a refused model keeps bitsandbytes' own state
        p.SCB, p.CB = scb, None      # the full rows' reference dropped (``rewrap`` gives each forward its own)
        if getattr(module, "state", None) is not None:
            module.state.CB = module.state.SCB = None
    for p, sites in inner.values():     # torchao weights: every site registers the same uint8 carrier
        layout = InnerBytes(p)
        carrier = nn.Parameter(layout.payload(p), requires_grad=False)
        carrier._fp_inner_bytes = layout
        for module, name in sites:
            module._parameters[name] = carrier
    return count + len(int8) + len(inner)


def _check_inner(where: str, p) -> None:
    """Refuse a torchao weight that cannot be sharded as its inner tensors' bytes (module doc)."""
    cls = _torchao_class(p)
    if cls not in _INNER or not hasattr(type(p), "__tensor_unflatten__"):
        raise ShardingError(
            f"{where} is a torchao {cls} weight: fp.shard shards torchao's NF4Tensor exactly (its inner tensors as "
            f"bytes) but not {cls}, and will not flatten it into values. Quantize the base with torchao's to_nf4 "
            "(torchtune's QLoRA) or bitsandbytes' nf4 (transformers.BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4')), or keep the module whole with ignored_modules")
    names, _ = p.__tensor_flatten__()
    inner = [getattr(p, n) for n in names]
    if p.requires_grad:
        raise ShardingError(
            f"{where} is a torchao {cls} weight with requires_grad=True: fp.shard shards NF4 bases frozen (their "
            "bytes are never updated); register it as nn.Parameter(to_nf4(w), requires_grad=False) and train "
            "adapters beside it")
    if any(t.is_meta or type(t) is not torch.Tensor for t in inner):
        raise ShardingError(
            f"{where} is a torchao {cls} weight whose inner tensors are not real tensors (on the meta device, "
            "built under fp.deferred_init(), or nested subclasses): fp.shard cannot shard bytes that do not exist "
            "yet. Quantize the weight (to_nf4) after its real values are loaded, then call fp.shard")


# The two ways to a sharded 4-bit base (named by the refusals below and in checkpoint/hf/quantized.py).
LOAD_4BIT_INSTEAD = (
    "for a full-precision checkpoint, build the model under fp.deferred_init() with bitsandbytes Linear4bit "
    "layers (transformers.integrations.replace_with_bnb_linear(model, modules_to_not_convert=['lm_head'], "
    "quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))), fp.shard(model), then "
    "fp.load_pretrained(model, path): each rank reads and quantizes only its own piece; or load the 4-bit base "
    "with transformers on every rank, from_pretrained(path, quantization_config=BitsAndBytesConfig("
    "load_in_4bit=True, ...)) (a checkpoint saved in 4-bit needs no quantization_config), then fp.shard(model): "
    "each rank holds the whole packed base (about 0.5 byte per parameter) until fp.shard keeps its 1/world")


def _not_quantized(where: str, p) -> str:
    """A 4-bit weight neither quantized nor recorded by fp.deferred_init (those the engine quantizes)."""
    return (f"{where} is a 4-bit weight that bitsandbytes has not quantized yet (Params4bit with "
            "bnb_quantized=False: a Linear4bit quantizes when moved to its device): fp.shard would shard its "
            "unquantized values as packed bytes. Call model.to(device) before fp.shard, or " + LOAD_4BIT_INSTEAD)


def refuse_load(model: nn.Module, names, path: str) -> None:
    """Raise when ``fp.load_pretrained`` would read into packed 8-bit weights or read a checkpoint saved
    quantized (4-bit ``quant_state`` entries, 8-bit ``weight_format``): it writes no ``SCB`` / ``quant_state``
    from such files, so packed bytes would sit beside another checkpoint's scales, or int8 codes be cast into
    float weights (a silently wrong model). A full-precision checkpoint into 4-bit weights is quantized shard by
    shard (``packed_quantize.py``, ``checkpoint/hf/quantized.py``). torchao NF4 weights are refused: their
    packed nibbles and block scalers would take checkpoint values."""
    nf4 = next((n for n, p in model.named_parameters() if inner_bytes(p) is not None), None)
    if nf4 is not None:
        raise ShardingError(
            f"fp.load_pretrained({path!r}) into a model with torchao NF4 weights ({nf4!r}) would write checkpoint "
            "values into their packed bytes (nibbles and block scalers): not supported. Load the checkpoint into "
            "the full-precision model first and quantize it with to_nf4 before fp.shard (torchtune's QLoRA does), "
            "load adapters into the sharded model with your adapter state dict, or resume with fp.load_checkpoint")
    int8 = next((n for n, p in model.named_parameters() if is_packed(p) and _bnb_class(p) == "Int8Params"), None)
    if int8 is not None:
        raise ShardingError(
            f"fp.load_pretrained({path!r}) into a model with 8-bit weights ({int8!r}) would load int8 rows "
            "without their SCB row scales: not supported (fp.load_pretrained quantizes into 4-bit weights only). "
            "Load the 8-bit base with from_pretrained(path, quantization_config=BitsAndBytesConfig("
            "load_in_8bit=True)), then fp.shard; load adapters with PEFT (PeftModel.from_pretrained / "
            "model.load_adapter) or resume with fp.load_checkpoint")
    saved = next((n for n in names if ".quant_state.bitsandbytes__" in n or n.endswith(".weight_format")), None)
    if saved is not None:
        raise ShardingError(
            f"{path} holds a bitsandbytes-quantized checkpoint ({saved!r}): fp.load_pretrained cannot build "
            f"quantized layers or their quant_state in a deferred or full-precision model. Instead, "
            f"{LOAD_4BIT_INSTEAD}")


def _int8_scales(where: str, module: nn.Module, p) -> torch.Tensor:
    """An 8-bit weight (``Linear8bitLt``): int8 rows sharded as bytes, row scales ``SCB`` (one fp32 per row) kept
    whole on the parameter; returns them (after a forward bitsandbytes keeps CB and SCB in ``module.state``)."""
    state = getattr(module, "state", None)
    if getattr(p, "has_fp16_weights", False) or getattr(state, "has_fp16_weights", False):
        raise ShardingError(
            f"{where} is a bitsandbytes 8-bit weight with has_fp16_weights=True ({type(module).__name__}): "
            "trainable float values that bitsandbytes quantizes again at every forward, which fp.shard does not "
            "shard. Load the base frozen in 8-bit (transformers.BitsAndBytesConfig(load_in_8bit=True)) or in 4-bit")
    if p.is_meta:
        raise ShardingError(
            f"{where} is a bitsandbytes 8-bit weight on the meta device (built under fp.deferred_init()?): fp.shard "
            "quantizes deferred 4-bit weights only (Linear4bit, then fp.load_pretrained quantizes each rank's piece). "
            "Build the skeleton in 4-bit (BitsAndBytesConfig(load_in_4bit=True)), or load the 8-bit base with "
            "from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True)), then fp.shard")
    scb = p.SCB if getattr(p, "SCB", None) is not None else getattr(state, "SCB", None)
    if scb is None or p.dtype != torch.int8:
        raise ShardingError(
            f"{where} is a bitsandbytes 8-bit weight that is not quantized yet ({p.dtype}, no SCB row scales: "
            "Linear8bitLt quantizes when moved to its device): call model.to(device) before fp.shard, or load it "
            "with from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))")
    return scb


def refuse_export(model: nn.Module, what: str, keys=None) -> None:
    """Raise when ``what`` would export a packed 4-bit weight: its bytes mean nothing without the
    ``quant_state`` tensors (absmax, quant_map, ...) that transformers writes beside it, which these exports do
    not write yet; a file without them loads as a silently wrong model. ``keys``: ``id``s of the parameters
    the export writes (None: all)."""
    for name, p in model.named_parameters():
        if inner_bytes(p) is not None and (keys is None or id(p) in keys):
            raise ShardingError(
                f"{what} would write the torchao {inner_bytes(p).cls.__name__} weight {name!r}, whose values are "
                "packed nibbles with block scalers that a safetensors file of plain tensors cannot hold: not "
                "supported. Save the adapters with PEFT's model.save_pretrained(dir) or your own adapter state "
                "dict (the base is unchanged: quantize the original checkpoint with to_nf4 again), use "
                "fp.full_state_dict (it holds the NF4Tensor, as the plain model's state_dict does), or "
                "fp.save_checkpoint for a resumable sharded checkpoint")
        if is_packed(p) and (keys is None or id(p) in keys):
            raise ShardingError(
                f"{what} would write the quantized weight {name!r} without its quantization state (4-bit "
                "quant_state: absmax, quant_map; 8-bit: SCB row scales): not supported. Save the adapters with "
                "PEFT's model.save_pretrained(dir) (the base is unchanged: the original checkpoint and "
                "quantization_config load it again), or use fp.save_checkpoint for a resumable sharded checkpoint")


def quant_state_entries(p, key: str) -> dict:
    """The ``state_dict()`` entries bitsandbytes writes beside packed weight ``key``, detached, on CPU: 4-bit
    (``Linear4bit._save_to_state_dict``) ``quant_state.as_dict(packed=True)`` under ``key + "."``; 8-bit
    (``Linear8bitLt``) the row scales ``SCB`` and ``weight_format`` (0: row-major) beside ``weight``; none for a
    torchao carrier (its value is the rebuilt subclass: ``state_value``)."""
    if inner_bytes(p) is not None:
        return {}
    if _bnb_class(p) == "Int8Params":
        prefix = key[:-len("weight")]
        return {prefix + "SCB": p.SCB.detach().cpu(), prefix + "weight_format": torch.tensor(0, dtype=torch.uint8)}
    return {f"{key}.{k}": v.detach().cpu() for k, v in p.quant_state.as_dict(packed=True).items()}


def state_value(p, value: torch.Tensor) -> torch.Tensor:
    """What the plain model's ``state_dict()`` holds for ``p`` given its full ``value``: a torchao carrier's
    rebuilt ``NF4Tensor`` (over ``value``'s bytes), anything else ``value`` itself."""
    layout = inner_bytes(p)
    return value if layout is None else layout.rebuild(value)
