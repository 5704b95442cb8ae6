"""Every torch API whose name or behaviour differs across the supported range, behind one name each.

The supported range is ``SUPPORTED`` (pyproject's ``torch`` bound says the same; README says why): the oldest
torch is what vLLM 0.20–0.26 pin (TRL's RL users), the newest is untested-but-allowed (no upper cap; CI runs the
newest the registry installs). Nothing else in the package branches on ``torch.__version__``: callers use the
names here, which pick the available form once, by feature where possible (an attribute, a probe), so a build
that back-ports a fix is judged by what it has, not by its number. docs/INTERNALS.md lists each API the engine
uses and the first torch that has it.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist

SUPPORTED = (2, 11)          # the oldest torch on which the whole suite passes (CI lane "torch-oldest")
SUPPORTED_TEXT = "torch >= 2.11"


def _version_tuple(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_torch(version: Optional[str] = None) -> None:
    """One clear error at ``import fsdp_plugin`` for a torch outside the range (instead of an AttributeError
    from deep inside a step): the installed version, the range, and the command that fixes it."""
    version = version or torch.__version__
    if _version_tuple(version) < SUPPORTED:
        raise ImportError(
            f"fsdp_plugin needs {SUPPORTED_TEXT}; this environment has torch {version}. Install a supported "
            f"torch (e.g. `pip install 'torch>={SUPPORTED[0]}.{SUPPORTED[1]}'`, or the build your CUDA image "
            "ships), or use an fsdp_plugin release that supports it.")


# ------------------------------------------------------------------ collectives into flat tensors
# torch 2.13 renamed all_gather_into_tensor/reduce_scatter_tensor to *_single (PR #186123) and deprecates the old
# names (a FutureWarning for the private _base forms); 2.11 and 2.12 have only the old names. New name first.
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_INTO = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """torch's native all-gather of equal chunks into one flat ``out`` (rank order)."""
    return _ALL_GATHER_INTO(out, inp, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                        async_op: bool = False):
    """torch's native reduce-scatter of one flat ``inp`` into this rank's chunk ``out``."""
    return _REDUCE_SCATTER_INTO(out, inp, op=op, group=group, async_op=async_op)


# ------------------------------------------------------------------ FLOP counting (planner)
# torch.utils.flop_counter's attention formulas count grouped-query attention (fewer key/value heads than query
# heads: what a GQA model hands SDPA with enable_gqa) only from torch 2.12 (PRs #177169/#177188); 2.11's raise
# "sdpa_flop_count: query/key/value shapes are incompatible", which crashed fp.plan on every GQA model. Each
# installed SDPA formula is asked once for a GQA count; one that refuses, or answers other than 2.12's
# formula, is replaced by that formula (below, term for term), so every torch counts a model alike.
# Left as torch has them: the varlen/nested internals (_flash_attention_forward, _efficient_attention_*,
# flex attention), which a fake run of SDPA never dispatches (the fused op's fake kernel is the leaf).
import functools as _functools

from torch.utils import flop_counter as _flop_counter

_SDPA_OPS = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_cudnn_attention")


def _dims(shape) -> tuple:
    return tuple(shape.shape if isinstance(shape, torch.Tensor) else shape)


def _gqa_shapes(name: str, query, key, value, grad_out=None) -> tuple:
    """(b, h_q, s_q, s_k, d_qk, d_v) of ``(batch, heads, seq, dim)`` shapes whose key/value heads divide the
    query's; AssertionError otherwise, as torch's formulas raise."""
    b, h_q, s_q, d_q = query
    b_k, h_kv, s_k, d_k = key
    b_v, h_v, s_v, d_v = value
    ok = b == b_k == b_v and h_kv == h_v and d_q == d_k and s_k == s_v and h_kv > 0 and h_q % h_kv == 0
    if grad_out is not None:
        ok = ok and tuple(grad_out) == (b, h_q, s_q, d_v)
    if not ok:
        raise AssertionError(f"{name}: query/key/value shapes are incompatible: q={tuple(query)}, k={tuple(key)}, "
                             f"v={tuple(value)}" + (f", grad_out={tuple(grad_out)}" if grad_out is not None else ""))
    return b, h_q, s_q, s_k, d_q, d_v


def sdpa_flop_count(query_shape, key_shape, value_shape) -> int:
    """Forward FLOPs of attention (torch >= 2.12's count, GQA included: key/value heads are broadcast to the
    query's): ``q @ k^T`` then ``scores @ v`` per query head, 2 FLOPs per multiply-add; causal masking is not
    discounted (torch's neither)."""
    b, h, s_q, s_k, d_q, d_v = _gqa_shapes("sdpa_flop_count", _dims(query_shape), _dims(key_shape),
                                           _dims(value_shape))
    scores = 2 * (b * h) * s_q * s_k * d_q          # [s_q, d_q] @ [d_q, s_k]
    out = 2 * (b * h) * s_q * d_v * s_k             # [s_q, s_k] @ [s_k, d_v]
    return scores + out


def sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape) -> int:
    """Backward FLOPs of attention (torch >= 2.12's count): the scores recomputed, then the gradients of
    ``scores @ v`` (two matmuls) and of ``q @ k^T`` (two)."""
    b, h, s_q, s_k, d_q, d_v = _gqa_shapes("sdpa_backward_flop_count", _dims(query_shape), _dims(key_shape),
                                           _dims(value_shape), _dims(grad_out_shape))
    scores = 2 * (b * h) * s_q * s_k * d_q          # q @ k^T again
    grad_scores = 2 * (b * h) * s_q * s_k * d_v     # grad_out @ v^T
    grad_v = 2 * (b * h) * s_k * d_v * s_q          # scores^T @ grad_out
    grad_q = 2 * (b * h) * s_q * d_q * s_k          # grad_scores @ k
    grad_k = 2 * (b * h) * d_q * s_k * s_q          # q^T @ grad_scores
    return scores + grad_scores + grad_v + grad_q + grad_k


def _sdpa_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _sdpa_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# a GQA probe with unequal sequence lengths and head dims (MLA's d_v != d_qk), so a formula is judged on it all
_PROBE_Q, _PROBE_KV, _PROBE_V, _PROBE_GRAD = (2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6), (2, 4, 3, 6)


def _counts_gqa(formula, backward: bool) -> bool:
    try:
        if backward:
            return formula(_PROBE_GRAD, _PROBE_Q, _PROBE_KV, _PROBE_V) == sdpa_backward_flop_count(
                _PROBE_GRAD, _PROBE_Q, _PROBE_KV, _PROBE_V)
        return formula(_PROBE_Q, _PROBE_KV, _PROBE_V) == sdpa_flop_count(_PROBE_Q, _PROBE_KV, _PROBE_V)
    except Exception:        # 2.11: AssertionError ("shapes are incompatible")
        return False


@_functools.lru_cache(maxsize=None)
def _flop_formulas() -> dict:
    formulas = dict(_flop_counter.flop_registry)
    aten = torch.ops.aten
    for name in _SDPA_OPS:
        for op, ours, backward in ((getattr(aten, name, None), _sdpa_flop, False),
                                   (getattr(aten, name + "_backward", None), _sdpa_backward_flop, True)):
            if op is not None and not _counts_gqa(formulas.get(op, lambda *a: None), backward):
                formulas[op] = ours
    return formulas


def flop_formulas() -> dict:
    """torch's ``flop_registry`` (op packet -> ``formula(*args, out_val=None, **kwargs)``: FLOPs), with the SDPA
    forward/backward formulas that cannot count grouped-query attention replaced by GQA-safe ones (a copy)."""
    return dict(_flop_formulas())


def stock_sdpa_counts_gqa() -> bool:
    """Whether the installed torch's own SDPA formulas count GQA (torch >= 2.12), i.e. nothing was replaced."""
    return all(_flop_formulas()[op] is _flop_counter.flop_registry[op] for op in _flop_counter.flop_registry)


# ------------------------------------------------------------------ process groups: c10d's private state
# Each name below is private torch API the engine cannot do without; each is probed here once, by attribute, and
# tests/test_compat.py asserts every probe holds on the running torch (so a rename fails CI, not a job).
from datetime import timedelta as _timedelta

_C10D = dist.distributed_c10d
HAS_GROUP_BACKEND = hasattr(dist.ProcessGroup, "_get_backend")          # ProcessGroup._get_backend(device)
HAS_PG_NAMES = hasattr(getattr(_C10D, "_world", None), "pg_names")       # _World.pg_names: {group: name}
HAS_DEFAULT_GROUP = hasattr(_C10D, "_get_default_group")
HAS_GROUP_ABORT = hasattr(dist.ProcessGroup, "abort")


def group_timeout(group, device: torch.device) -> Optional[_timedelta]:
    """The timeout ``group``'s backend for ``device`` was created with (ProcessGroupNCCL's watchdog, gloo's own
    deadline; None: the default group). None where the backend exposes none (torch's fake group, a backend
    without options) — the caller then cannot check it."""
    if not HAS_GROUP_BACKEND:
        return None
    group = group if group is not None else default_group()
    if group is None:
        return None
    try:
        backend = group._get_backend(torch.device(device.type))
    except RuntimeError:        # no backend for this device type in the group
        return None
    return getattr(getattr(backend, "options", None), "_timeout", None)


def group_named(name: str):
    """The live process group torch registered under ``name`` (``group_name``), or None."""
    names = getattr(_C10D._world, "pg_names", {}) if HAS_PG_NAMES else {}
    return next((g for g, n in names.items() if n == name), None)


def default_group():
    """The default (world) process group, or None before ``init_process_group``."""
    if not dist.is_initialized():
        return None
    return _C10D._get_default_group() if HAS_DEFAULT_GROUP else dist.group.WORLD


def abort_group(group) -> bool:
    """``group.abort()``: every thread blocked on its communicator is released, the communicator is lost.
    False where this torch's ProcessGroup has no abort (torch's watchdog, a longer timeout, is then the
    backstop); errors of the abort itself propagate."""
    abort = getattr(group, "abort", None) if HAS_GROUP_ABORT else None
    if abort is None:
        return False
    abort()
    return True


# ------------------------------------------------------------------ storages and pinned host memory
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def storage_use_count(storage: "torch.UntypedStorage") -> Optional[int]:
    """References to the StorageImpl (tensors, views, Parameters, storage objects); None where torch has no
    such probe (callers then assume it is referenced)."""
    return _STORAGE_USE_COUNT(storage._cdata) if _STORAGE_USE_COUNT is not None else None


def cuda_host_register(ptr: int, nbytes: int) -> int:
    """Page-lock ``nbytes`` of host memory at ``ptr`` (``cudaHostRegister``, flags 0); the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def cuda_host_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


# ------------------------------------------------------------------ autograd's device threads (torch 2.11)
@_functools.lru_cache(maxsize=None)
def start_autograd_engine() -> None:
    """One real backward on CPU before the first fake one. The autograd engine sizes its device threads once, at
    its first backward; when that backward is on fake tensors, torch 2.11 starts device threads (not 2.13), and
    every fork-based child of the process then fails its first backward ("Unable to handle autograd's threading
    in combination with fork-based multiprocessing": multiprocessing ranks or tests started after fp.plan).
    Started by a real CPU backward, the engine has only the threads the process's devices need, as in training.
    Harmless on every torch, so not gated on the version: a back-ported fix changes nothing."""
    with torch.enable_grad():
        torch.ones(1, requires_grad=True).sum().backward()


# ------------------------------------------------------------------ _grouped_mm's meta kernel
def _grouped_mm_meta_needs_bf16() -> bool:
    """Whether ``aten._grouped_mm``'s meta kernel refuses float32 (it enforces the CUDA kernel's bfloat16, while
    the CPU kernel — what transformers' MoE experts call there — takes any float). Probed once, at import: the
    planner asks inside a FakeTensorMode, where a probe could not build its meta tensors."""
    try:
        op = torch.ops.aten._grouped_mm.default
    except (AttributeError, RuntimeError):
        return False
    def runs(dtype) -> bool:     # by behaviour, not by message: torch 2.13 says "BF16", 2.14 "BFloat16"
        a = torch.empty(16, 16, device="meta", dtype=dtype)
        b = torch.empty(2, 16, 16, device="meta", dtype=dtype)
        try:
            op(a, b, torch.empty(2, dtype=torch.int32, device="meta"))
        except RuntimeError:
            return False
        return True
    return not runs(torch.float32) and runs(torch.bfloat16)


GROUPED_MM_META_NEEDS_BF16 = _grouped_mm_meta_needs_bf16()


def fake_grouped_mm(func, args, kwargs):
    """``aten._grouped_mm`` on fake/meta tensors of any float dtype: where the meta kernel wants bfloat16, shaped
    on bfloat16 stand-ins and returned in the real dtype; else as is."""
    if GROUPED_MM_META_NEEDS_BF16 and (args[0].dtype != torch.bfloat16 or args[1].dtype != torch.bfloat16):
        dtype = kwargs.get("out_dtype") or args[0].dtype
        stand_in = func(args[0].to(torch.bfloat16), args[1].to(torch.bfloat16), *args[2:],
                        **{**kwargs, "out_dtype": None})
        return stand_in.to(dtype)
    return func(*args, **kwargs)


# ------------------------------------------------------------------ torch's fake process group
def fake_store():
    """torch's ``FakeStore`` (the store ``init_process_group("fake", ...)`` takes). torch ships it only under
    ``torch.testing._internal`` (every supported torch); users reach it through ``fsdp_plugin.testing.fake_world``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


HAS_DEFAULT_STORE = hasattr(_C10D, "_get_default_store")
HAS_PG_MAP = hasattr(getattr(_C10D, "_world", None), "pg_map")


def default_store():
    """The default group's store (the rendezvous store every rank shares), or None before init."""
    return _C10D._get_default_store() if dist.is_initialized() and HAS_DEFAULT_STORE else None


def live_groups() -> list:
    """Every process group torch still holds (``_World.pg_map``); the world group alone where it cannot say."""
    if not dist.is_initialized():
        return []
    return list(_C10D._world.pg_map) if HAS_PG_MAP else [dist.group.WORLD]


# ------------------------------------------------------------------ autograd
_GRAPH_TASK_ID = getattr(torch._C, "_current_graph_task_id", None)


def in_backward() -> bool:
    """Whether this thread is running autograd's backward now (a graph task is current)."""
    return _GRAPH_TASK_ID is not None and _GRAPH_TASK_ID() != -1


# ------------------------------------------------------------------ DeviceMesh
def root_mesh(mesh):
    """The DeviceMesh ``mesh`` was sliced from (itself when not a slice): ``DeviceMesh._get_root_mesh``, the only
    form on every supported torch."""
    get = getattr(mesh, "_get_root_mesh", None)
    if get is None:
        raise RuntimeError(f"this torch's DeviceMesh has no _get_root_mesh: fsdp_plugin supports {SUPPORTED_TEXT} "
                           "up to the newest release it was tested on; report the torch version")
    return get()


# ------------------------------------------------------------------ tensor subclasses
def make_subclass(cls, data: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """``data``'s storage as an instance of the tensor subclass ``cls``, no copy (what ``nn.Parameter`` and
    bitsandbytes' ``Params4bit`` are built with: ``torch.Tensor._make_subclass``, private but on every torch)."""
    return torch.Tensor._make_subclass(cls, data, requires_grad)


def outside_fake_mode():
    """A context in which tensors are real again inside a ``FakeTensorMode`` (``fp.plan``'s fake run builds the
    context-parallel layout, host metadata the engine reads values from, as real CPU tensors)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    return unset_fake_temporarily()
