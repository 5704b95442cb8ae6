"""TRL's vLLM weight sync (GRPO, RLOO, online DPO with ``use_vllm=True``) through ``fp.iter_full_params``.

With our engine the Trainer keeps ``is_fsdp_enabled = False``, so TRL would take its non-FSDP path and hand
vLLM each rank's local rows under full parameter names. We replace the one TRL function that produces the
named tensors, for the TRL versions whose code we read:

* ``trl.generation.vllm_generation.VLLMGeneration._iter_named_params`` (GRPO, RLOO; server mode feeds it to
  ``VLLMClient.update_named_params``, packed buckets; colocate mode to ``load_weights``);
* ``trl.experimental.online_dpo.OnlineDPOTrainer._move_model_to_vllm_inner`` (online DPO: one
  ``update_named_param`` / ``load_weights`` per tensor).

The replacements stream checkpoint (``"hf"``) names unit by unit, PEFT adapters merged on the fly (the model
is never merged and unmerged); server mode yields on the main process only, colocate mode on every rank (each
has its own engine). They defer to TRL's own code for a model our engine does not shard. Another TRL version
with ``use_vllm=True`` on our engine is refused by name when the Trainer is created.
"""
from __future__ import annotations

import functools
import importlib
import sys
from typing import Any

#: TRL releases whose vLLM sync code the replacements below were written against.
KNOWN_TRL = ("1.16.0",)

_TARGETS = (  # (module, class, method, replacement name)
    ("trl.generation.vllm_generation", "VLLMGeneration", "_iter_named_params", "_iter_named_params"),
    ("trl.experimental.online_dpo.online_dpo_trainer", "OnlineDPOTrainer", "_move_model_to_vllm_inner",
     "_move_model_to_vllm_inner"),
)
_ORIGINALS: dict[tuple[str, str], Any] = {}


def _sharded(model) -> bool:
    import fsdp_plugin as fp

    return model is not None and fp.is_sharded(model)


def _is_peft(model) -> bool:
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _stream(model, colocate: bool):
    import fsdp_plugin as fp

    return fp.iter_full_params(model, names="hf", merge_lora=_is_peft(model), ranks="all" if colocate else (0,))


def _iter_named_params(stock, self):
    """``(checkpoint name, full tensor)`` one unit at a time; every process iterates (TRL's contract)."""
    if not _sharded(self.model):
        yield from stock(self)
        return
    yield from _stream(self.model, self.mode == "colocate")


def _move_model_to_vllm_inner(stock, self):
    if not _sharded(self.model):
        return stock(self)
    colocate = self.vllm_mode == "colocate"
    for name, tensor in _stream(self.model, colocate):
        if colocate:
            self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])
        else:
            self.vllm_client.update_named_param(name, tensor)
    return None


def _bind(stock, replacement):
    @functools.wraps(stock)
    def method(self, *args, **kwargs):
        return replacement(stock, self, *args, **kwargs)

    method.__fsdp_plugin__ = True
    return method


def trl_version() -> str | None:
    mod = sys.modules.get("trl")
    return getattr(mod, "__version__", None) if mod is not None else None


def patch_loaded() -> None:
    """Replace the sync functions of the TRL modules already imported (a TRL trainer's module imports them)."""
    if trl_version() not in KNOWN_TRL:
        return
    for module, cls_name, method, replacement in _TARGETS:
        mod = sys.modules.get(module)
        cls = getattr(mod, cls_name, None) if mod is not None else None
        if cls is None or (module, method) in _ORIGINALS:
            continue
        stock = cls.__dict__[method]
        _ORIGINALS[(module, method)] = stock
        setattr(cls, method, _bind(stock, globals()[replacement]))


def unpatch() -> None:
    for (module, method), stock in _ORIGINALS.items():
        cls_name = next(c for m, c, meth, _ in _TARGETS if (m, meth) == (module, method))
        setattr(getattr(importlib.import_module(module), cls_name), method, stock)
    _ORIGINALS.clear()


def prepare(trainer) -> None:
    """At Trainer creation on our engine: patch TRL's sync, or refuse ``use_vllm=True`` on an unknown TRL."""
    if not getattr(getattr(trainer, "args", None), "use_vllm", False) or \
            not type(trainer).__module__.startswith("trl."):
        return
    version = trl_version()
    if version not in KNOWN_TRL:
        from fsdp_plugin.errors import UnsupportedError

        raise UnsupportedError(
            f"TRL {version} with use_vllm=True on fsdp_plugin: its vLLM weight sync was written for torch FSDP "
            f"and fsdp_plugin replaces it only for TRL {', '.join(KNOWN_TRL)} (on an unknown TRL it would send "
            f"each rank's local pieces); install trl=={KNOWN_TRL[-1]}, or push weights yourself with "
            "fp.iter_full_params(model)")
    patch_loaded()
