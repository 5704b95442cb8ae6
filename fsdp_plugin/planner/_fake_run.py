"""One forward+backward of the model on fake tensors, recording what the schedule needs.

The parameters are swapped for fake tensors on the target device (``FakeTensorMode``: shapes, dtypes and
the device's kernel choices, no storage), so nothing is allocated and e.g. the CPU flash-attention kernel is
chosen exactly as in a real run. A dispatch mode counts the bytes of every storage an op creates and frees
it when the storage dies: the activation curve, temporaries included, is *measured*, not estimated. Unit
boundaries (forward pre/post, backward pre, gradient ready) are recorded as events with the activation
bytes live at that moment and the maximum since the previous event; `_replay` lays the engine's
unshard/reshard/reduce schedule over that curve. Parameter gradients are kept until their flat buffer would
be complete, then dropped: the replay accounts them as the unit's flat gradient.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .._build.precision import forward_restorer, install_casts
from .. import _compat
from .._compat import flop_formulas
from .errors import PlanError

_aten = torch.ops.aten
# torch's formulas (GQA-safe attention on every torch: `_compat`), plus the CPU flash-attention kernels (same
# arguments as the CUDA ones, absent from the registry: without them CPU attention would be priced as memory
# traffic).
_FLOP_FORMULAS = flop_formulas()
_FLOP_FORMULAS.update({
    _aten._scaled_dot_product_flash_attention_for_cpu: _FLOP_FORMULAS[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _FLOP_FORMULAS[_aten._scaled_dot_product_flash_attention_backward],
})


def _grouped_mm_flop(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """``aten._grouped_mm`` (transformers' grouped MoE experts, forward and backward), absent from torch's registry:
    every row of ``mat_a`` meets one group's matrix, 2 FLOPs per multiply-add. 2-D x 2-D (the weight gradient:
    the groups split the contraction) contracts each of ``mat_a``'s elements with one row of ``mat_b``."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.numel() * mat_b.shape[-1]
    return 2 * out_val.numel() * mat_a.shape[-1]


_FLOP_FORMULAS[_aten._grouped_mm] = _grouped_mm_flop


def _fake_call(func, args, kwargs):
    """``func`` on fake tensors (``aten._grouped_mm``: through ``_compat``, whose meta kernel may want bfloat16)."""
    if func is _aten._grouped_mm.default:
        return _compat.fake_grouped_mm(func, args, kwargs)
    return func(*args, **kwargs)


@dataclass
class Event:
    kind: str        # pre_forward | post_forward | pre_backward | grad_ready | grads_dropped | end_backward
    index: int       # unit index (handle index for grad_ready)
    in_backward: bool
    act_now: int     # activation bytes live at the event
    act_max: int     # largest activation bytes since the previous event


@dataclass
class Timeline:
    events: list = field(default_factory=list)
    act_peak: int = 0
    act_end: int = 0
    flops: int = 0               # matmul/conv/attention FLOPs of forward+backward (recompute included)
    attention_flops: int = 0     # the attention kernels' share of ``flops`` (their own, lower, throughput)
    other_bytes: int = 0         # bytes read+written by every other op (memory-bound work)
    input_bytes: int = 0
    ops: int = 0                 # aten ops dispatched (host overhead per op is part of the step time)


def _scalar_of(t: torch.Tensor) -> bool:
    """A Python value read from a fake tensor (``bool(t)``, ``t.item()``), which has no data. A boolean is a
    model's consistency check of its inputs (LLaVA's ``torch_compilable_check`` that image tokens and image
    features match): the micro-batch given is taken to be valid, so it holds. Any other value would choose
    shapes or branches from data the plan cannot see."""
    if t.dtype is torch.bool:
        return True
    raise PlanError(f"fp.plan: the model's forward reads a {t.dtype} value from a tensor (.item(), .tolist() or a "
                    "Python branch on data), which a fake run cannot know; plan it with inputs that avoid that "
                    "path (for a VLM: text-only inputs, the tower's held parameters are still counted)")


class _Tracker(TorchDispatchMode):
    """Live bytes of storages created under the mode; a storage is freed when its StorageImpl dies."""

    def __init__(self, timeline: Timeline):
        super().__init__()
        self.tl, self.live, self.seg_max, self._seen = timeline, 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return _scalar_of(args[0])      # a real tensor's value (host metadata built real) is simply read
        out = _fake_call(func, args, kwargs or {})
        kind, amount = op_cost(func, args, kwargs, out)
        if kind == "meta":
            return out
        self.tl.ops += 1
        self.tl.flops += amount if kind in ("flop", "attention") else 0
        self.tl.attention_flops += amount if kind == "attention" else 0
        self.tl.other_bytes += amount if kind == "bytes" else 0
        in_keys = {_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            k = _key(t)
            if k in in_keys or k in self._seen:
                continue
            st = t.untyped_storage()
            n = st.nbytes()
            self._seen.add(k)
            self.live += n
            self.seg_max = max(self.seg_max, self.live)
            self.tl.act_peak = max(self.tl.act_peak, self.live)
            weakref.finalize(st, self._free, k, n)
        return out

    def _free(self, key, n) -> None:
        self._seen.discard(key)
        self.live -= n

    def mark(self, kind: str, index: int, in_backward: bool) -> None:
        self.tl.events.append(Event(kind, index, in_backward, self.live, self.seg_max))
        self.seg_max = self.live


def _tensors(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def op_cost(func, args, kwargs, out) -> tuple:
    """The planner's price of one aten op, shared with the calibration workload (`_workload`) so that the
    throughputs are measured in the units they are applied to: ("flop", FLOPs) for matmul/conv,
    ("attention", FLOPs) for fused attention kernels (CPU bf16: 25-50 GFLOP/s against ~150 for matmuls),
    ("view", 0), ("meta", 0) for ``prim`` metadata queries (FakeTensor dispatches ``prim.device`` on every
    ``.device`` read, ~1000 per GPT-small step, each "reading" its whole tensor; a real run dispatches none),
    else ("bytes", bytes of every tensor argument and output)."""
    if func.namespace == "prim":
        return "meta", 0
    # FLOPs counted with torch's formulas, not under FlopCounterMode: its module tracker hooks the outputs of
    # activation-checkpoint recomputation and keeps those graphs (and their tensors) alive to the end of
    # backward, which the real run frees unit by unit.
    count_flops = _FLOP_FORMULAS.get(func._overloadpacket)
    if count_flops is not None:
        kind = "attention" if "attention" in func._overloadpacket.__name__ else "flop"
        return kind, int(count_flops(*args, **(kwargs or {}), out_val=out))
    if func.is_view:
        return "view", 0
    return "bytes", sum(t.numel() * t.element_size() for t in _tensors((args, kwargs)) + _tensors(out))


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def default_loss(output) -> torch.Tensor:
    """``output.loss`` if present, else the output (or its first tensor) summed."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().sum() if output.dim() else output
    first = next((t for t in tree_flatten(output if not hasattr(output, "values") else list(output.values()))[0]
                  if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    if first is None:
        raise PlanError("the model output has no floating tensor to differentiate: pass loss_fn=callable(output)")
    return first.float().sum()


@dataclass
class RunSpec:
    device: torch.device
    compute_dtype: Optional[torch.dtype]     # mixed precision param_dtype (None: the model's dtypes)
    buffer_dtype: Optional[torch.dtype]
    cast_inputs: bool
    checkpoint_policy: object                 # activation_checkpointing policy or None
    fp32_regions: list = field(default_factory=list)   # MixedPrecision.fp32_modules (precision.fp32_regions)
    fp32_buffers: set = field(default_factory=set)     # (id(module), name) of buffers kept in their dtype


def run(model: nn.Module, units, handles, spec: RunSpec, inputs: Callable, loss_fn) -> Timeline:
    """Fake forward+backward of ``model`` (left as it was found) with the engine's unit boundaries marked."""
    _compat.start_autograd_engine()   # torch 2.11: before the first fake backward (why: there)
    tl = Timeline()
    restore_fwd = _checkpoint(model, spec.checkpoint_policy)
    restore_casts = install_casts(spec.fp32_regions, spec.compute_dtype, spec.device.type)
    # real CPU tensors may enter ops as constants: the context-parallel layout's indices and tile masks are host
    # metadata built real (``_context.py``); every parameter and input is still made fake explicitly
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with fake_mode:
            restore_params = _fake_parameters(model, spec, {i for h in handles if h.fp32 for i in h.param_ids})
        try:
            _run_marked(model, units, handles, spec, inputs, loss_fn, fake_mode, tl)
        finally:
            restore_params()
    finally:
        restore_casts()
        restore_fwd()
    return tl


def _checkpoint(model: nn.Module, policy) -> Callable[[], None]:
    """Apply fp.shard's activation checkpointing to ``model``; return a function that undoes it."""
    if policy is None:
        return lambda: None
    from .._build.checkpointing import apply_activation_checkpointing

    restore = forward_restorer(list(model.modules()))
    apply_activation_checkpointing(model, policy)
    return restore


def _fake_parameters(model: nn.Module, spec: RunSpec, fp32_ids: set) -> Callable[[], None]:
    """Swap every parameter/buffer for a fake tensor (compute dtype, target device); ties are kept. Parameters
    in ``fp32_ids`` (fp32 modules') compute in float32 (or wider), as the engine's handles do."""
    fakes: dict[int, torch.Tensor] = {}
    undo = []

    def fake_of(t: torch.Tensor, cast) -> torch.Tensor:
        if id(t) not in fakes:
            dtype = cast if (cast is not None and t.is_floating_point()) else t.dtype
            f = torch.empty_strided(t.shape, t.stride() if t.is_contiguous() else _contig(t.shape),
                                    dtype=dtype, device=spec.device)
            if isinstance(t, nn.Parameter):
                f = nn.Parameter(f, requires_grad=t.requires_grad)
                f._fp_plan_orig = id(t)
            fakes[id(t)] = f
        return fakes[id(t)]

    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                undo.append((m._parameters, name, p))
                wide = torch.float32 if p.element_size() <= 4 else None
                m._parameters[name] = fake_of(p, wide if id(p) in fp32_ids else spec.compute_dtype)
        for name, b in list(m._buffers.items()):
            if b is not None:
                undo.append((m._buffers, name, b))
                m._buffers[name] = fake_of(b, None if (id(m), name) in spec.fp32_buffers else spec.buffer_dtype)

    def restore():
        for table, name, orig in undo:
            table[name] = orig
    return restore


def _contig(shape) -> tuple:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _as_call(batch):
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _fake_inputs(batch, fake_mode, spec: RunSpec, tl: Timeline):
    def conv(x):
        if not isinstance(x, torch.Tensor):
            return x
        tl.input_bytes += x.numel() * x.element_size()
        f = fake_mode.from_tensor(x)
        with fake_mode:
            if spec.cast_inputs and spec.compute_dtype is not None and f.is_floating_point():
                f = f.to(spec.compute_dtype)
            return f.to(spec.device)
    return tree_map(conv, batch)


def _run_marked(model, units, handles, spec, inputs, loss_fn, fake_mode, tl: Timeline) -> None:
    tracker = _Tracker(tl)
    st = {"bwd": False, "depth": [0] * len(units), "started": set()}
    params_by_orig = {getattr(p, "_fp_plan_orig", None): p for p in model.parameters()}
    hooks = _unit_hooks(units, tracker, st)
    hooks += _grad_hooks(handles, params_by_orig, tracker, st)
    args, kwargs = _as_call(_fake_inputs(inputs(), fake_mode, spec, tl))
    try:
        with fake_mode, tracker:
            out = model(*args, **kwargs)
            loss = loss_fn(out) if loss_fn is not None else default_loss(out)
            loss.backward()
            st["bwd"] = True
            _flush_incomplete(handles, params_by_orig, tracker, st)
            tracker.mark("end_backward", -1, True)
            tl.act_end = tracker.live
            del out, loss
    finally:
        for hk in hooks:
            hk.remove()


def _unit_hooks(units, tracker: _Tracker, st: dict) -> list:
    """Mirror of the engine's unit hooks: forward pre/post (nesting counted), backward pre (once)."""
    hooks = []
    for i, u in enumerate(units):
        def pre(module, args, i=i):
            st["depth"][i] += 1
            if st["depth"][i] == 1:
                tracker.mark("pre_forward", i, st["bwd"])

        def pre_backward(grad, i=i):
            st["bwd"] = True
            if i not in st["started"]:
                st["started"].add(i)
                tracker.mark("pre_backward", i, True)
            return grad

        def post(module, args, output, i=i, pre_backward=pre_backward):
            st["depth"][i] -= 1
            if st["depth"][i] > 0:
                return output
            tracker.mark("post_forward", i, st["bwd"])
            if not st["bwd"] and torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad:
                        t.register_hook(pre_backward)
            return output
        hooks.append(u.module.register_forward_pre_hook(pre))
        hooks.append(u.module.register_forward_hook(post, always_call=True))
    return hooks


def _grad_hooks(handles, params_by_orig: dict, tracker: _Tracker, st: dict) -> list:
    """A handle's flat gradient is complete once every one of its parameters has its gradient."""
    hooks = []
    st["got"] = {h: set() for h in range(len(handles))}
    st["done"] = set()
    for h, spec in enumerate(handles):
        if not spec.requires_grad:
            continue
        params = [params_by_orig[pid] for pid in spec.param_ids if pid in params_by_orig]

        def on_grad(p, h=h, params=params):
            st["bwd"] = True
            st["got"][h].add(id(p))
            if len(st["got"][h]) == len(params) and h not in st["done"]:
                _complete(h, params, tracker, st)
        hooks += [p.register_post_accumulate_grad_hook(on_grad) for p in params]
    return hooks


def _complete(h: int, params, tracker: _Tracker, st: dict) -> None:
    st["done"].add(h)
    tracker.mark("grad_ready", h, True)     # per-parameter gradients still alive: the flat one is built now
    for p in params:
        p.grad = None
    tracker.mark("grads_dropped", h, True)


def _flush_incomplete(handles, params_by_orig, tracker: _Tracker, st: dict) -> None:
    """Handles whose unused parameters got no gradient complete at the end of backward (zeros fill them)."""
    for h, spec in enumerate(handles):
        if spec.requires_grad and st["got"][h] and h not in st["done"]:
            _complete(h, [params_by_orig[pid] for pid in spec.param_ids if pid in params_by_orig], tracker, st)
