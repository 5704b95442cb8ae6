"""bitsandbytes 4-bit layers in ``fp.plan``: their fake run and the ``quant_state`` every rank holds whole.

A fake run cannot call ``Linear4bit.forward``: it rebuilds a ``Params4bit`` around the weight (a fake tensor
cannot become one) and needs a ``quant_state``, which a skeleton built under ``fp.deferred_init()`` has not got
yet (bitsandbytes asserts "quantization state not initialized"). For the run each 4-bit layer's forward is
replaced by what bitsandbytes' training path (``MatMul4Bit``) costs: the weight dequantized to the compute dtype
(a temporary of the full-precision shape), a matmul with the input, the temporary freed; backward dequantizes
again (the packed bytes, not the dequantized weight, are saved) and multiplies by the output gradient. The
packed bytes themselves are priced as the handles fp.shard builds (``_units.py``: storage dtype, never cast).
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from .._flat import packed_quantize
from .._flat.packed import is_4bit


def layers(model: nn.Module) -> list:
    """The bitsandbytes 4-bit layers (registering a ``Params4bit`` weight, packed or pending) of ``model``; not
    PEFT's LoRA wrappers, whose ``weight`` property reads their base layer's."""
    return [m for m in model.modules() if is_4bit(m._parameters.get("weight"))]


def state_bytes(model: nn.Module) -> int:
    """The ``quant_state`` bytes every rank holds whole (absmax, code books; ``packed_quantize.state_bytes``)."""
    return sum(packed_quantize.state_bytes(m.weight) for m in layers(model))


class _Dequantized(torch.autograd.Function):
    """``x @ W.T + bias`` with W dequantized in the forward and again in the backward (``MatMul4Bit``)."""

    @staticmethod
    def forward(ctx, x, bias, shape):
        ctx.shape = shape
        w = torch.empty(shape, dtype=x.dtype, device=x.device)
        return torch.nn.functional.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        w = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return torch.matmul(grad, w), bias, None


def _stand_in(module: nn.Module):
    shape = packed_quantize.float_shape(module.weight)

    def forward(x, *args, **kwargs):
        dtype = x.dtype
        compute = getattr(module, "compute_dtype", None) or dtype
        bias = module.bias.to(compute) if module.bias is not None else None
        return _Dequantized.apply(x.to(compute), bias, shape).to(dtype)
    return forward


@contextlib.contextmanager
def stand_ins(model: nn.Module):
    """Every 4-bit layer of ``model`` runs its stand-in forward inside the block (restored after)."""
    found = [(m, m.__dict__.get("forward")) for m in layers(model)]
    for m, _ in found:
        m.forward = _stand_in(m)
    try:
        yield
    finally:
        for m, own in found:
            if own is None:
                del m.forward
            else:
                m.forward = own


def notes(model: nn.Module) -> list:
    """One plan note for a model with 4-bit layers: how they are priced."""
    found = layers(model)
    if not found:
        return []
    pending = sum(packed_quantize.pending(m.weight) for m in found)
    return [f"{len(found)} bitsandbytes 4-bit weights" + (f" ({pending} not quantized yet: deferred)" if pending
            else "") + ": their packed bytes sharded as fp.shard shards them, quant_state "
            f"({state_bytes(model):,} bytes) whole on every rank (in buffers), each dequantized to the compute dtype "
            "while its layer runs (forward and backward)"]


def refuse_8bit(model: nn.Module) -> None:
    """bitsandbytes' 8-bit layers are not modelled: their forward reads ``weight.CB``/``SCB``, which a fake run has not
    got, and their int8 matmul temporaries are not priced here. Refused by name, not planned wrong."""
    from .._flat.packed import is_8bit
    from .errors import PlanError

    name = next((n for n, m in model.named_modules() if is_8bit(m._parameters.get("weight"))), None)
    if name is not None:
        raise PlanError(f"fp.plan does not price bitsandbytes 8-bit layers yet ({name!r} is a Linear8bitLt): plan "
                        "the model in 4-bit (load_in_4bit=True) for a lower bound or unquantized for an upper one, or "
                        "measure a step (torch.cuda.max_memory_allocated)")
