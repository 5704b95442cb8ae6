"""`ShardingConfig` and `MixedPrecision`: the single source of truth for how a model is sharded.

Integrations (Lightning, Accelerate) translate their options into a ShardingConfig; the engine reads
nothing else. Validation that needs no process group happens in ``__post_init__``; checks that need the
world (the mesh divides the world) happen when ``fp.shard`` builds the mesh (``_groups/mesh.py``).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from ._build.strategy import STRATEGIES as _STRATEGY_TABLE
from .errors import ConfigError

STRATEGIES = tuple(_STRATEGY_TABLE)
SKIP_INIT = "skip"
PAIRING_CHECKS = ("auto", "strict", "off")
CP_ATTENTION = ("allgather", "ring", "ulysses")

WrapPolicy = Union[None, set, frozenset, tuple, list, Callable[[nn.Module], bool]]


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and communication; the fp32 master shard is never cast in place.

    param_dtype: dtype of the unsharded parameters used by forward/backward (and of the all-gather).
    reduce_dtype: dtype gradients are reduced in. ``None`` means float32 when param_dtype is a
        low-precision float (bf16 reduction hurts at scale), else param_dtype.
    buffer_dtype: dtype buffers are cast to at shard time (None: unchanged).
    cast_forward_inputs: cast floating-point forward inputs of the root to param_dtype.
    master_dtype: dtype of the sharded master copy of *trainable* parameters stored in a narrower float
        (a model loaded in bf16) when param_dtype is a 16-bit float: float32 by default, so the optimizer
        steps and keeps its state in fp32 (what stock accelerate's FSDP does). Frozen parameters (a LoRA
        base) keep the dtype they were loaded in, and so do all parameters without a 16-bit param_dtype.
        None keeps every master in its loaded dtype (bf16 masters and optimizer state: half the memory).
    fp32_modules: modules that compute in float32 inside 16-bit units (norms, MoE routers): a tuple (a single
        entry is accepted too) of ``nn.Module`` classes (isinstance) and strings. A string matches a module
        whose class name equals it, or whose qualified name, or one of its own parameters' or buffers' names,
        contains it (``re.search``, ``*`` = any characters: transformers' rule for its lists). Their
        parameters get their own flat handle per unit, gathered, computed and reduced in float32 (trainable ones
        get fp32 masters even with ``master_dtype=None``); their 16-bit inputs are cast to float32 and their
        float32 outputs back to ``param_dtype`` (torch FSDP2's ``MixedPrecisionPolicy(param_dtype=float32,
        output_dtype=param_dtype)`` on the module); their buffers skip ``buffer_dtype``. Needs a 16-bit
        ``param_dtype``. In addition, always: the parameters a model declares by transformers' rule
        (``_keep_in_fp32_modules_strict`` under fp16 and bf16, ``_keep_in_fp32_modules`` under fp16) stay
        float32 with no casts, as ``from_pretrained(dtype=...)`` leaves them (set the attribute to None on the
        model to opt out, as in transformers). See ``_build/precision.py``.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    master_dtype: Optional[torch.dtype] = torch.float32
    fp32_modules: tuple = ()

    def __post_init__(self):
        for name in ("param_dtype", "reduce_dtype", "buffer_dtype", "master_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ConfigError(f"MixedPrecision.{name}={value!r}: use a floating torch dtype such as "
                                  "torch.bfloat16, torch.float16 or torch.float32, or None")
        object.__setattr__(self, "fp32_modules", _fp32_entries(self.fp32_modules))
        if self.fp32_modules and not self.low_precision:
            raise ConfigError(f"MixedPrecision(fp32_modules={self.fp32_modules!r}) with param_dtype="
                              f"{self.param_dtype}: fp32 modules only differ from the rest under 16-bit "
                              "compute; set param_dtype=torch.bfloat16 (or float16), or drop fp32_modules")

    @property
    def low_precision(self) -> bool:
        """Compute is a 16-bit float (the only case in which masters and fp32 modules differ from compute)."""
        return self.param_dtype is not None and self.param_dtype.itemsize < 4

    def master_dtype_for(self, dtype: torch.dtype, requires_grad: bool, fp32: bool = False) -> torch.dtype:
        """The sharded master dtype of a parameter stored in ``dtype`` (see ``master_dtype``); ``fp32``: the
        parameter belongs to an fp32 module, whose trainable parameters always get at least fp32 masters."""
        master = torch.float32 if fp32 and (self.master_dtype is None or self.master_dtype.itemsize < 4) \
            else self.master_dtype
        if not (self.low_precision and requires_grad and master is not None and dtype.is_floating_point):
            return dtype
        return master if dtype.itemsize < master.itemsize else dtype

    def effective_reduce_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        return torch.float32 if (self.param_dtype or param_dtype).itemsize < 4 else (self.param_dtype or param_dtype)


def _fp32_entries(value) -> tuple:
    """``MixedPrecision.fp32_modules`` in its one normal form: a tuple of nn.Module classes and patterns."""
    entries = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(entries, (tuple, list, set, frozenset)) or not all(map(_valid_fp32_entry, entries)):
        bad = [e for e in entries if not _valid_fp32_entry(e)] if isinstance(entries, (tuple, list, set, frozenset)) \
            else value
        raise ConfigError(f"MixedPrecision(fp32_modules={value!r}): {bad!r} is not a module class or a name "
                          "pattern; use a tuple of nn.Module classes and/or strings (a class name such as "
                          "'LlamaRMSNorm', or a qualified-name pattern such as 'mlp.gate' or 'layers.*.norm'), "
                          "or () for none")
    if isinstance(entries, (set, frozenset)):    # one order, so that equal policies compare equal
        return tuple(sorted(entries, key=lambda e: e if isinstance(e, str) else e.__qualname__))
    return tuple(dict.fromkeys(entries))


def _valid_fp32_entry(entry) -> bool:
    if isinstance(entry, type):
        return issubclass(entry, nn.Module)
    if not isinstance(entry, str) or not entry.strip():
        return False
    try:
        re.compile(entry.replace("*", ".*"))
    except re.error:
        return False
    return True


class _SizePolicy:
    """Wrap a module as a unit when its not-yet-wrapped subtree holds at least ``min_params`` elements."""

    def __init__(self, min_params: int):
        if int(min_params) <= 0:
            raise ConfigError(f"size_policy(min_params={min_params}): use a positive number of parameters")
        self.min_params = int(min_params)

    def __repr__(self):
        return f"size_policy({self.min_params})"


def size_policy(min_params: int = 100_000_000) -> _SizePolicy:
    """Auto-wrap policy: every module whose unwrapped subtree has >= ``min_params`` parameter elements."""
    return _SizePolicy(min_params)


@dataclass(frozen=True)
class Checkpointing:
    """Which modules recompute their activations in backward, and how (``ShardingConfig.activation_checkpointing``).

    modules: module classes, a callable(module) -> bool or `size_policy(n)`; None: every unit but the root.
    every: recompute only every k-th selected module: those at index 0, k, 2k, ... among the selected modules
        in ``model.modules()`` order (1: all of them). The others keep their activations.
    selective: False recomputes the whole module (saves only its inputs); True is torch's selective
        checkpointing: the outputs of matmuls and attention kernels are kept, the pointwise rest (norms,
        activations, dropout, residual adds) is recomputed -- more memory than whole-module, less compute.
    """

    modules: WrapPolicy = None
    every: int = 1
    selective: bool = False

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"Checkpointing(every={self.every!r}): use a positive int (1 recomputes every "
                              "selected module, 2 every second one, ...)")
        if not isinstance(self.selective, bool):
            raise ConfigError(f"Checkpointing(selective={self.selective!r}): use True (keep matmul/attention "
                              "outputs, recompute the rest) or False (recompute the whole module)")
        if isinstance(self.modules, (Checkpointing, bool)):
            raise ConfigError(f"Checkpointing(modules={self.modules!r}): use module classes, a "
                              "callable(module) -> bool, fp.size_policy(n) or None (every non-root unit)")


def as_checkpointing(value) -> Optional[Checkpointing]:
    """``ShardingConfig.activation_checkpointing`` in its one normal form: None (off) or a `Checkpointing`.
    True means every non-root unit; classes, callables and size policies are the ``modules`` to recompute."""
    if value is None or value is False:
        return None
    if isinstance(value, Checkpointing):
        return value
    if value is True:
        return Checkpointing()
    if isinstance(value, (set, frozenset, tuple, list)) and all(isinstance(c, type) for c in value) \
            or isinstance(value, _SizePolicy) or callable(value) and not isinstance(value, type):
        return Checkpointing(modules=value)
    raise ConfigError(f"activation_checkpointing={value!r}: use True (every unit but the root), module classes, "
                      "a callable(module) -> bool, fp.size_policy(n), fp.Checkpointing(modules, every=k, "
                      "selective=True) or None")


QUANTIZED_FORMATS = ("int8", "int4")


@dataclass(frozen=True)
class Quantization:
    """Opt-in quantized collectives (ZeRO++'s qwZ and qgZ; ``ShardingConfig.quantization``).

    weights: "int8" all-gathers the unit parameters as int8 with one float32 scale per block of ``block_size``
        elements (symmetric round-to-nearest, scale = absmax/127): every gathered weight is within half a
        quantization step (scale/2) of the exact value, and every rank holds the same dequantized copy. The
        master shards, the optimizer step and checkpoints stay exact. None: exact all-gathers.
    gradients: "int8" reduces gradients as an all-to-all of int8 blocks (+ scales) whose receivers dequantize
        and sum in float32, rounded stochastically (unbiased): each reduced element is within ``sum over the
        other ranks of their block scale`` of the exact sum (one quantization per hop; an all-reduce -- no_shard,
        hybrid's cross-replica hop -- adds the re-quantized sum's scale). "int4" (ZeRO++'s qgZ width): the same
        with 4-bit codes, scale = absmax/7, two codes per byte: half int8's bytes (7.5x fewer than float32 at
        block 256), each hop's error 18x int8's (still < one scale per element, unbiased); experimental: the
        demo GPT's 300-step loss lands between -1.3% and +2.8% of exact over seeds (int8: +0.6% on average;
        benchmarks/RESULTS_lab_notes.md § 35j). None: exact.
    block_size: elements per scale, a multiple of 8 in [8, 65536]. 256 costs 4/256 bytes of scales per element
        (int8 + scales = 3.94x fewer bytes than float32, 1.97x fewer than bfloat16).

    Where: on one node every collective asked for is quantized. Across nodes (``LOCAL_WORLD_SIZE`` < world) a
    collective whose group lies inside one node stays exact -- hybrid_shard's shard all-gather and
    reduce-scatter, hpZ's backward all-gather -- since its bytes never reach the inter-node link: only the
    collectives that cross it pay the quantization's compute and error.
    """

    weights: Optional[str] = None
    gradients: Optional[str] = None
    block_size: int = 256

    def __post_init__(self):
        if self.weights == "int4":
            raise ConfigError("Quantization(weights='int4'): int4 is for gradients only (rounded to nearest, a "
                              "4-bit weight is off by up to absmax/14 in every forward); use weights='int8'")
        for name in ("weights", "gradients"):
            value = getattr(self, name)
            if value is not None and value not in QUANTIZED_FORMATS:
                raise ConfigError(f"Quantization({name}={value!r}): use 'int8' (block-quantized, one float32 "
                                  "scale per block), 'int4' (gradients only) or None (exact)")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 8 or b > 65536 or b % 8:
            raise ConfigError(f"Quantization(block_size={b!r}): use a multiple of 8 between 8 and 65536 "
                              "(elements per float32 scale; 256 is the default)")

    @property
    def enabled(self) -> bool:
        return self.weights is not None or self.gradients is not None


def _check_quantization(q, strategy: str) -> None:
    if q is None:
        return
    if not isinstance(q, Quantization):
        raise ConfigError(f"quantization={q!r}: use fp.Quantization(weights='int8', gradients='int8') or None")
    if q.weights is not None and strategy == "no_shard":
        raise ConfigError("Quantization(weights='int8') with sharding_strategy='no_shard': no_shard never "
                          "all-gathers weights, so there is nothing to quantize; drop weights= (gradients= "
                          "still applies) or use full_shard, shard_grad_op or hybrid_shard")


@dataclass
class ShardingConfig:
    """How `fp.shard` shards a model.

    sharding_strategy: "full_shard" (ZeRO-3), "shard_grad_op" (ZeRO-2: keep parameters unsharded from
        forward to backward), "no_shard" (DDP-like all-reduce), "hybrid_shard" (shard inside a group,
        all-reduce across groups).
    auto_wrap_policy: which modules become units: a set of module classes, a callable(module) -> bool,
        `size_policy(n)`, or None (the repeated blocks: children of a ModuleList/Sequential sharing one class,
        or a Hugging Face model's ``_no_split_modules``).
    device_mesh: None (whole world; hybrid: replicate across nodes, shard inside a node from LOCAL_WORLD_SIZE),
        a (replicate, shard) tuple, or a 2-D DeviceMesh (dims: replicate, shard).
    param_init_fn: for meta-device models: callable(module) that initializes the module's own parameters
        in place; None uses a transformers model's own ``_init_weights`` (else each module's
        ``reset_parameters()``); "skip" leaves zero-filled shards and persistent buffers (a checkpoint fills
        them next) but still computes non-persistent buffers, which no checkpoint holds.
    reshard_after_forward: per-unit override of the strategy's choice to free a unit's full parameters after
        its forward (all-gathered again in backward): None (full_shard, hybrid_shard: True, except the last
        unit in forward order, whose backward comes first and would be all-gathered again at once;
        shard_grad_op, no_shard: False), a bool for every unit, a set of module classes whose units reshard
        (others keep them), or ``callable(fqn, module) -> bool`` (e.g. ``lambda fqn, m: fqn != "layers.11"``).
        An int ``r`` is hpZ (ZeRO++; FSDP2's meaning): every unit but the root keeps, after its forward, a
        secondary shard over groups of ``r`` consecutive ranks of its shard group, so its backward all-gather
        stays inside them (pick the ranks per node: it never crosses nodes); ``r`` must divide the shard group
        size, costs ``M/r`` bytes per rank between forward and backward (M: the units' full parameters in the
        compute dtype), and moves no extra bytes; 1 is False, the shard group size is True.
        The root unit never reshards after forward.
    backward_prefetch / forward_prefetch: issue the next unit's all-gather early.
    limit_all_gathers: bound the number of unsharded units alive at once (memory).
    cpu_offload: keep shards, gradients and optimizer state on CPU (a no-op on CPU-only machines).
    activation_checkpointing: which modules recompute their activations in backward: None (off), True (every
        unit but the root), module classes, a callable(module) -> bool, `size_policy(n)`, or
        ``fp.Checkpointing(modules, every=k, selective=True)`` for every k-th module and torch's selective
        checkpointing (keep matmul/attention outputs, recompute the pointwise rest).
    ignored_modules: modules whose parameters stay unsharded and unmanaged.
    some_ranks_modules: modules whose forward may run on some ranks only in a step, or on none, or more than
        once (a vision tower when only some ranks hold images, an audio encoder, a rarely routed expert): module
        classes, class names (``"CLIPVisionModel"``), a callable(module) -> bool, or None (no such module: every
        unit must run on every rank or on none, else the pairing check raises CollectiveError). Each outermost
        match becomes one unit (units the wrap policy picks inside it merge into it) on a rank-independent
        schedule: every rank all-gathers it in the root's pre-forward, keeps it unsharded to the end of
        backward, and reduce-scatters its gradient there (zeros from ranks that did not run it; skipped, grads
        left None, when no rank did). Exact single-process/DDP gradients; master and optimizer state stay
        sharded. Cost: the unit's full parameters (and, where it ran, its full gradient) held all step, and its
        reduction is not overlapped with backward compute.
    timeout_s: seconds a collective may wait for the other ranks before raising CollectiveError (naming
        the rank, unit and collective) instead of hanging; None reads FSDP_PLUGIN_TIMEOUT_S, default 480 (NCCL's
        default group timeout, 600, less the 120 s backstop margin).
    device: where unsharded parameters live (default: the current CUDA device under NCCL -- call
        ``torch.cuda.set_device(local_rank)`` first, as NCCL requires -- else the model's device).
    pairing_check: how a divergence between ranks (a unit run on some ranks only) is caught, as a
        CollectiveError naming each rank's unit: "auto" (default; the host never waits for another rank before
        issuing a unit collective: identity tags on gloo/CPU, a ledger hash folded into the step's one control
        all-reduce elsewhere, checked before any optimizer step can use the gradients), "strict" (also a
        blocking announcement before every native collective: the error is raised at the collective itself,
        at one host round trip each), or "off" (no check, torch FSDP2's behaviour: a divergence may abort gloo
        or mix data silently).
    quantization: None (exact collectives) or ``fp.Quantization(weights="int8", gradients="int8",
        block_size=256)``: block-quantized weight all-gathers and/or gradient reductions (ZeRO++ qwZ/qgZ).
    expert_parallel: None/1 (off) or E: expert parallelism inside data parallel (dp2ep) for transformers 5 MoE
        models. Every rank keeps its own batch; each experts module sends its tokens by all-to-all to the E ranks
        of its EP group that own their experts (``num_experts / E`` each) and gets the results back; those experts
        are flat-sharded over the remaining ``shard_size / E`` ranks, everything else as without EP. E must
        divide the shard group size and every experts module's expert count (checked at fp.shard). Exact:
        the same numbers as one process on the global batch. See ``fsdp_plugin/_experts/``.
    expert_capacity_factor: None (dropless, exact: the default) or c > 0 under expert_parallel: each rank sends
        at most ``ceil(c * tokens * top_k / num_experts)`` routes per expert per experts call (its own tokens),
        the first in token order; the rest are dropped (they add nothing to their token's output). Bounds the
        all-to-all receive buffer; NOT the one-process numbers of the model (which is dropless): inexact by design.
    context_parallel: C > 1 splits every sequence over C consecutive ranks (a Hugging Face model's attention
        goes through transformers' attention registry; README "Long sequences (context parallel)"): world =
        data-parallel x C, parameters shard over the shard group (which holds whole CP groups), gradients are
        summed over a CP group and averaged over data parallel. Every rank of a CP group passes the same full
        batch; ``fp.data_parallel_rank/size(model)`` is what samplers split the data by.
    context_parallel_attention: how a split attention layer sees the whole sequence: "allgather" (each rank
        gathers the group's un-repeated K/V: any head count), "ring" (the same attention, K/V blocks rotated
        around the group: the same bytes in C−1 steps, 2 K/V blocks held per rank instead of C) or "ulysses"
        (all-to-all from sequence to heads and back, 4 per layer: query and K/V head counts must divide by
        context_parallel). Bytes per rank and layer relative to "allgather": (H + Hkv) / (C * Hkv), so Ulysses
        moves less once C > 1 + H / Hkv (MHA: C > 2).
    """

    sharding_strategy: str = "full_shard"
    auto_wrap_policy: WrapPolicy = None
    mixed_precision: Optional[MixedPrecision] = None
    device_mesh: object = None
    param_init_fn: Union[None, str, Callable[[nn.Module], None]] = None
    backward_prefetch: bool = True
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    cpu_offload: bool = False
    activation_checkpointing: Union[WrapPolicy, bool, "Checkpointing"] = None
    ignored_modules: Iterable[nn.Module] = field(default_factory=tuple)
    some_ranks_modules: Union[None, set, frozenset, tuple, list, Callable[[nn.Module], bool]] = None
    timeout_s: Optional[float] = None
    device: Optional[torch.device] = None
    reshard_after_forward: Union[None, bool, int, set, frozenset, tuple, list, Callable[[str, nn.Module], bool]] = None
    # issue 30: the pairing check off the host's critical path (one contiguous block, validated below)
    pairing_check: str = "auto"
    quantization: Optional[Quantization] = None
    expert_parallel: Optional[int] = None     # issue 55 (``_experts/``)
    expert_capacity_factor: Optional[float] = None    # issue 55: token dropping under EP (inexact, opt-in)
    # issue 54: context parallelism (fsdp_plugin/_context/)
    context_parallel: int = 1
    context_parallel_attention: str = "allgather"

    def __post_init__(self):
        strategy = str(self.sharding_strategy).lower()
        if strategy not in STRATEGIES:
            raise ConfigError(f"unknown sharding_strategy {self.sharding_strategy!r}: use one of {', '.join(STRATEGIES)}")
        self.sharding_strategy = strategy
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise ConfigError("mixed_precision must be fp.MixedPrecision(param_dtype=..., reduce_dtype=...) or None, "
                              f"not {type(self.mixed_precision).__name__}")
        if isinstance(self.param_init_fn, str) and self.param_init_fn != SKIP_INIT:
            raise ConfigError(f"param_init_fn={self.param_init_fn!r}: use a callable, None or {SKIP_INIT!r}")
        if self.device_mesh is not None and self.sharding_strategy != "hybrid_shard" and isinstance(self.device_mesh, tuple):
            raise ConfigError(f"device_mesh={self.device_mesh} is a (replicate, shard) shape, which only "
                              "sharding_strategy='hybrid_shard' uses; drop device_mesh or choose hybrid_shard")
        if isinstance(self.device_mesh, tuple) and (len(self.device_mesh) != 2 or min(self.device_mesh) < 1):
            raise ConfigError(f"device_mesh={self.device_mesh}: give (replicate, shard) with two positive sizes")
        self.ignored_modules = tuple(self.ignored_modules or ())
        as_checkpointing(self.activation_checkpointing)   # validates; kept as given (integrations compare it)
        _check_reshard_rule(self.reshard_after_forward)
        _check_some_ranks_rule(self.some_ranks_modules)
        if self.pairing_check not in PAIRING_CHECKS:
            raise ConfigError(f"pairing_check={self.pairing_check!r}: use one of {', '.join(map(repr, PAIRING_CHECKS))} "
                              "('auto': cheap and safe, the default; 'strict': blocking announcements; 'off': none)")
        self.device = torch.device(self.device) if self.device is not None else None
        _check_quantization(self.quantization, self.sharding_strategy)
        ep = self.expert_parallel
        if ep is not None and (isinstance(ep, bool) or not isinstance(ep, int) or ep < 1):
            raise ConfigError(f"expert_parallel={ep!r}: use a positive int E (the ranks an MoE layer's experts are "
                              "split over, dividing the shard group size and the expert count) or None (off)")
        cf = self.expert_capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < float("inf")):
            raise ConfigError(f"expert_capacity_factor={cf!r}: use a positive float (routes kept per expert: "
                              "ceil(factor * tokens * top_k / num_experts) per rank) or None (dropless, exact)")
        if cf is not None and ep in (None, 1):
            raise ConfigError(f"expert_capacity_factor={cf} without expert_parallel: it limits the routes each rank "
                              "sends to an expert's EP rank; set expert_parallel=E > 1 or drop it")
        cp = self.context_parallel
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise ConfigError(f"context_parallel={cp!r}: use a positive int, the ranks that split one sequence "
                              "(1: off)")
        if self.context_parallel_attention not in CP_ATTENTION:
            raise ConfigError(f"context_parallel_attention={self.context_parallel_attention!r}: use one of "
                              f"{', '.join(map(repr, CP_ATTENTION))}")
        if cp > 1 and ep not in (None, 1):
            raise ConfigError(f"context_parallel={cp} with expert_parallel={ep}: not supported together yet (the "
                              "experts' gradient divisor does not know the CP group); drop one of them")

    @classmethod
    def from_kwargs(cls, config: "ShardingConfig | None" = None, **kwargs) -> "ShardingConfig":
        """Merge keyword overrides into ``config`` (or defaults), rejecting unknown names."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown ShardingConfig option(s) {unknown}; valid options: {sorted(names)}")
        if config is None:
            return cls(**kwargs)
        if not isinstance(config, ShardingConfig):
            raise ConfigError(f"fp.shard(model, config): config must be a ShardingConfig, not {type(config).__name__}")
        return dataclasses.replace(config, **kwargs)


def _check_some_ranks_rule(rule) -> None:
    if rule is None or callable(rule) and not isinstance(rule, type):
        return
    if isinstance(rule, (set, frozenset, tuple, list)) and all(
            isinstance(c, str) or isinstance(c, type) and issubclass(c, nn.Module) for c in rule):
        return
    raise ConfigError(f"some_ranks_modules={rule!r}: use a set of module classes or class names (e.g. "
                      "{'CLIPVisionModel'}), a callable(module) -> bool, or None")


def _check_reshard_rule(rule) -> None:
    if rule is None or isinstance(rule, bool) or callable(rule) and not isinstance(rule, type):
        return
    if isinstance(rule, int):
        if rule < 1:
            raise ConfigError(f"reshard_after_forward={rule}: an int is hpZ's secondary group size (ranks per node, "
                              "e.g. 8); it must be >= 1 and divide the shard group size")
        return
    if isinstance(rule, (set, frozenset, tuple, list)) and all(isinstance(c, type) for c in rule):
        return
    raise ConfigError(f"reshard_after_forward={rule!r}: use None (the strategy's default), True/False, a set of "
                      "module classes whose units reshard, an int (hpZ: the secondary group size), or a callable(fqn, module) -> bool")
