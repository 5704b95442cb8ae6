"""``fsdp_cpu_ram_efficient_loading``: only rank 0 reads pretrained weights; the other ranks build on meta.

With the flag on (accelerate config ``fsdp_cpu_ram_efficient_loading: true``, or
``TrainingArguments(fsdp_config={"cpu_ram_efficient_loading": True})`` created before the model), in a
multi-process launch, ``PreTrainedModel.from_pretrained`` on every rank but 0 loads with
``device_map="meta"`` (transformers' own config/dtype handling, no weights in memory). When the model is
prepared, the engine finds rank 0 real and the others on meta and scatters rank 0's values, unit by unit
(buffers too). transformers 5 itself loads full weights on every rank, so without this the flag would
save nothing.

A quantized model (bitsandbytes 4/8-bit: ``quantization_config``, or a checkpoint saved quantized) loads on every
rank as without the flag, with a warning: its scales (``quant_state``, ``SCB``) are Python attributes that the
engine cannot scatter from rank 0, and a meta ``Params4bit`` is not quantized, so every rank quantizes its own
copy (the same bytes) and ``prepare`` shards it.

Importing this module patches nothing: :func:`install` does (called by fsdp_plugin's ``Accelerator`` when the
flag is on, and by the transformers ``Trainer`` integration), patching only ``from_pretrained``.
"""
from __future__ import annotations

import functools
import os
import warnings

_ORIGINAL: list = []


def ram_efficient_loading_requested(env=None) -> bool:
    """The flag is on and this process is not global rank 0 of a multi-process launch."""
    env = os.environ if env is None else env
    on = str(env.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")).strip().lower() in ("1", "true", "yes")
    world, rank = int(env.get("WORLD_SIZE", "1") or 1), int(env.get("RANK", "0") or 0)
    return on and world > 1 and rank != 0


def _wrap(stock):
    @functools.wraps(stock.__func__)
    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("device_map") is not None or not ram_efficient_loading_requested():
            return stock.__func__(cls, *args, **kwargs)
        model = stock.__func__(cls, *args, **{**kwargs, "device_map": "meta"})
        if getattr(model, "hf_quantizer", None) is not None:     # the module doc: every rank loads it
            warnings.warn(
                "fsdp_cpu_ram_efficient_loading: this quantized model loads on every rank, not on rank 0 only "
                "(its quant_state / SCB scales cannot be sent from rank 0): each rank holds the whole quantized "
                "base (about 0.5 byte per parameter in 4-bit) until the model is prepared, which keeps 1/world "
                "of it", stacklevel=2)
            return stock.__func__(cls, *args, **kwargs)
        # Not a device map the user chose: leaving it would make Trainer/accelerate treat the model as
        # dispatched across devices (model parallel).
        for m in model.modules():
            m.__dict__.pop("hf_device_map", None)
        return model

    return classmethod(from_pretrained)


def install() -> None:
    """Patch ``PreTrainedModel.from_pretrained``. Idempotent."""
    from transformers import PreTrainedModel

    if _ORIGINAL:
        return
    stock = PreTrainedModel.__dict__["from_pretrained"]
    _ORIGINAL.append(stock)
    PreTrainedModel.from_pretrained = _wrap(stock)


def uninstall() -> None:
    """Restore the stock method."""
    from transformers import PreTrainedModel

    if _ORIGINAL:
        PreTrainedModel.from_pretrained = _ORIGINAL.pop()
