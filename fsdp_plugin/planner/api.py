"""`fp.plan`: memory per rank, bytes on the wire and step time of a sharded job, before it starts."""
from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from ..config import MixedPrecision, ShardingConfig
from . import _optim as _optim
from ._capture import ModelSource, capture, hf_inputs
from ._fake_run import RunSpec, Timeline, run
from ._result import Plan, WorldPlan
from ._time import HARDWARE, Calibration, calibrate, default_for, for_hardware
from ._units import discover_units
from .errors import PlanError

_MP = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def plan(model: ModelSource, world_size: Union[int, Iterable[int]] = 1, sharding_strategy: str = "full_shard",
         auto_wrap_policy=None, optimizer: str = "adamw", inputs: Optional[Callable] = None, loss_fn=None,
         mixed_precision: Union[None, str, MixedPrecision] = None, activation_checkpointing=None,
         cpu_offload: bool = False, backward_prefetch: bool = True, forward_prefetch: bool = False,
         limit_all_gathers: bool = True, batch_size: int = 1, seq_len: int = 128, device=None,
         calibration: Union[None, str, Calibration] = None, gpus_per_node: int = 8, ignored_modules=(),
         foreach: Optional[bool] = None) -> Plan:
    """Predict per-rank memory, wire bytes and step time of ``fp.shard(model, ...)`` training, allocating nothing.

    model: a callable building the model (run on the meta device), an ``nn.Module`` (meta is fine), a Hugging
        Face config path, or ``"pkg.module:factory"``.
    world_size: one size or several; ``Plan.peak_bytes[w]`` is the peak device bytes of the worst rank at w.
    inputs: callable returning one micro-batch *per rank* (a tensor, tuple of args or dict of kwargs); it is
        converted to fake tensors. None: token ids of ``(batch_size, seq_len)`` (with labels for HF models).
    loss_fn: callable(output) -> scalar; None: ``output.loss`` if present, else the output (or its first
        floating tensor) summed.
    activation_checkpointing: None/False, True (recompute every unit), or a ShardingConfig policy.
    calibration: None (assumed throughputs for ``device``), "calibrate" (measure here, collectively under a
        process group), a name in ``HARDWARE`` (e.g. "a100-80gb"), or a ``Calibration``.
    """
    opts = dict(auto_wrap_policy=auto_wrap_policy, optimizer=optimizer, inputs=inputs, loss_fn=loss_fn,
                mixed_precision=mixed_precision, activation_checkpointing=activation_checkpointing,
                cpu_offload=cpu_offload, backward_prefetch=backward_prefetch, forward_prefetch=forward_prefetch,
                limit_all_gathers=limit_all_gathers, batch_size=batch_size, seq_len=seq_len, device=device,
                calibration=calibration, gpus_per_node=gpus_per_node, ignored_modules=ignored_modules,
                foreach=foreach)
    return plan_strategies(model, world_size, [sharding_strategy], **opts)[0]


def plan_strategies(model: ModelSource, world_size, strategies: list, **opts) -> list:
    """`plan` for several strategies from one fake run (the run does not depend on the strategy)."""
    worlds = sorted({int(world_size)} if isinstance(world_size, int) else {int(w) for w in world_size})
    if not worlds or min(worlds) < 1:
        raise PlanError(f"world_size={world_size!r}: give a positive size or a list of them")
    mp = _mixed_precision(opts["mixed_precision"])
    ac = opts["activation_checkpointing"] if opts["activation_checkpointing"] is not False else None
    cfgs = [ShardingConfig(sharding_strategy=s, auto_wrap_policy=opts["auto_wrap_policy"], mixed_precision=mp,
                           cpu_offload=opts["cpu_offload"], backward_prefetch=opts["backward_prefetch"],
                           forward_prefetch=opts["forward_prefetch"], limit_all_gathers=opts["limit_all_gathers"],
                           ignored_modules=opts["ignored_modules"]) for s in strategies]
    opt = _optim.check(opts["optimizer"])
    named_gpu = isinstance(opts["calibration"], str) and opts["calibration"] in HARDWARE
    device = torch.device(opts["device"] or ("cuda" if torch.cuda.is_available() or named_gpu else "cpu"))
    module = capture(model)
    units, handles = discover_units(module, cfgs[0].auto_wrap_policy, cfgs[0].ignored_modules)
    ac_policy = _ac_policy(ac, cfgs[0].auto_wrap_policy, units)
    run_device = device if (device.type != "cuda" or torch.cuda.is_available()) else torch.device("cpu")
    spec = RunSpec(run_device, mp.param_dtype if mp else None, mp.buffer_dtype if mp else None,
                   mp.cast_forward_inputs if mp else False, ac_policy)
    make_inputs = opts["inputs"] or _default_inputs(module, opts["batch_size"], opts["seq_len"])
    tl = run(module, units, handles, spec, make_inputs, opts["loss_fn"])
    cal = _calibration(opts["calibration"], device, mp)
    foreach = device.type == "cuda" if opts["foreach"] is None else opts["foreach"]
    notes = _notes(run_device, device, opts["cpu_offload"]) + (
        [f"target {device.type} has no device here: activations measured with CPU kernels"]
        if run_device != device else [])
    out = []
    for cfg in cfgs:
        per_world = {w: _world(w, cfg, units, handles, tl, module, opt, cal, foreach, opts["gpus_per_node"], device)
                     for w in worlds}
        out.append(Plan(model=_name(model, module), num_params=sum(h.numel for h in handles),
                        strategy=cfg.sharding_strategy, optimizer=opt,
                        mixed_precision=str(mp.param_dtype).replace("torch.", "") if mp and mp.param_dtype else None,
                        activation_checkpointing=ac_policy is not None, micro_batch=_describe_inputs(tl),
                        units=_unit_rows(units, handles), worlds=per_world, flops_per_step=tl.flops,
                        calibration=_cal_dict(cal, worlds), notes=list(notes)))
    return out


def _mixed_precision(mp) -> Optional[MixedPrecision]:
    if mp is None or isinstance(mp, MixedPrecision):
        return mp
    if isinstance(mp, torch.dtype):
        return MixedPrecision(param_dtype=mp)
    if str(mp).lower() in _MP:
        return MixedPrecision(param_dtype=_MP[str(mp).lower()])
    if str(mp).lower() in ("fp32", "float32", "none", "no"):
        return None
    raise PlanError(f"mixed_precision={mp!r}: use 'bf16', 'fp16', a torch dtype, fp.MixedPrecision(...) or None")


def _ac_policy(ac, wrap_policy, units):
    """True means "recompute every unit": the wrap classes, else exactly the non-root unit modules."""
    if ac is None:
        return None
    if ac is True:
        if isinstance(wrap_policy, (set, frozenset, tuple, list)):
            return set(wrap_policy)
        ids = {id(u.module) for u in units[1:]}
        return lambda m: id(m) in ids
    return ac


def _default_inputs(module: nn.Module, batch_size: int, seq_len: int) -> Callable:
    def make():
        args, kwargs = hf_inputs(module, batch_size, seq_len)
        return kwargs if kwargs else args
    return make


def _world(w, cfg, units, handles, tl, module, opt, cal, foreach, gpus_per_node, device) -> WorldPlan:
    from ._world import world_plan
    return world_plan(w, cfg, units, handles, tl, module, opt, cal, foreach, gpus_per_node, device)


def _calibration(calibration, device: torch.device, mp):
    """A Calibration, or a function of the world size (named hardware: bandwidth depends on nodes)."""
    if calibration is None:
        return default_for(device)
    if isinstance(calibration, Calibration):
        return calibration
    if isinstance(calibration, dict):
        return Calibration(**calibration)
    if calibration in ("calibrate", True):  # seconds of measuring: rank 0 says how far it got
        import torch.distributed as dist

        from .._progress import Progress
        shown = not dist.is_initialized() or dist.get_rank() == 0
        progress = Progress("plan --calibrate", unit="measurements") if shown else None
        return calibrate(device, mp.param_dtype if mp and mp.param_dtype else torch.float32, progress=progress)
    if calibration in HARDWARE:
        return lambda w: for_hardware(calibration, w)
    raise PlanError(f"calibration={calibration!r}: use None, 'calibrate', a Calibration, or one of "
                    f"{', '.join(HARDWARE)}")


def _cal_dict(cal, worlds) -> dict:
    if callable(cal):
        return {"source": cal(worlds[0]).source, **{f"world {w}": cal(w).to_dict() for w in worlds}}
    return cal.to_dict()


def _name(source, module: nn.Module) -> str:
    return source if isinstance(source, str) else type(module).__name__


def _describe_inputs(tl: Timeline) -> str:
    return f"{tl.input_bytes:,} input bytes per rank"


def _unit_rows(units, handles) -> list:
    rows = []
    for u in units:
        hs = [handles[i] for i in u.handles]
        rows.append({"name": u.name, "params": sum(h.numel for h in hs),
                     "bytes": sum(h.numel * h.dtype.itemsize for h in hs)})
    return rows


def _notes(device: torch.device, target: torch.device, cpu_offload: bool) -> list:
    notes = [f"activations measured by one fake forward+backward on {device.type}; allocator rounding and "
             "fragmentation are not included"]
    if target.type == "cpu":
        notes.append("CPU target: the peak includes the CPU runtime's own heap (kernel caches, a constant measured "
                     "once: WorldPlan.runtime)")
    if cpu_offload:
        notes.append("cpu_offload: shards, gradients and optimizer state are in host memory (host_bytes)")
    return notes
