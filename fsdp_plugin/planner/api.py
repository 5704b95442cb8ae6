"""`fp.plan`: memory per rank, bytes on the wire and step time of a sharded job, before it starts."""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from .._build.precision import fp32_buffers, fp32_regions
from ..config import Checkpointing, MixedPrecision, ShardingConfig, as_checkpointing
from ..errors import ConfigError
from . import _context, _experts, _latency, _optim as _optim, _quantized, _tp
from ._capture import ModelSource, capture, hf_inputs
from ._fake_run import RunSpec, Timeline, run
from ._layer_sizes import LayerSizes
from ._links import Links
from ._result import Plan, WorldPlan
from ._time import HARDWARE, Calibration, calibrate, default_for, for_hardware
from ._units import discover_units
from .errors import PlanError

_MP = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


_RUN_DEFAULTS = dict(optimizer="adamw", inputs=None, loss_fn=None, batch_size=1, seq_len=128, device=None,
                    calibration=None, gpus_per_node=8, foreach=None, nodes=None, link_gbps=None,
                    link_latency_us=None, tp_size=1, tp_plan=None)
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(ShardingConfig))


def plan(model: ModelSource, world_size: Union[int, Iterable[int]] = 1, config: Optional[ShardingConfig] = None,
         **options) -> Plan:
    """Predict per-rank memory, wire bytes and step time of ``fp.shard(model, config)`` training, allocating nothing.

    model: a callable building the model (run on the meta device), an ``nn.Module`` (meta is fine), a Hugging
        Face config path, or ``"pkg.module:factory"``.
    world_size: one size or several; ``Plan.peak_bytes[w]`` is the peak device bytes of the worst rank at w.
    config: the ``ShardingConfig`` the job passes to ``fp.shard`` (default: its defaults). Any of its fields
        may also be given as a keyword, overriding it and validated as ``ShardingConfig`` validates; two
        shorthands: ``mixed_precision="bf16"`` (or "fp16", a dtype) and ``activation_checkpointing=True``
        (recompute every unit).
    Run options (keywords): ``optimizer`` ("adamw", "sgd", ...); ``inputs``: callable returning one micro-batch
        *per rank* (a tensor, tuple of args or dict of kwargs), converted to fake tensors; None: token ids of
        ``(batch_size, seq_len)`` (with labels for HF models); ``loss_fn``: callable(output) -> scalar (None:
        ``output.loss`` if present, else the output summed); ``device``; ``calibration``: None (assumed
        throughputs for ``device``), "calibrate" (measure here, collectively under a process group), a name in
        ``HARDWARE`` (e.g. "a100-80gb") or a ``Calibration``; ``gpus_per_node``; ``foreach``;
        ``nodes`` / ``link_gbps`` / ``link_latency_us``: the job spans ``nodes`` nodes (``world / nodes`` ranks
        each: this replaces ``gpus_per_node``) joined by links of ``link_gbps`` Gbit/s per node and direction;
        every collective is priced at the link its group uses (``_links.py``): ``WorldPlan.inter_node_bytes``,
        ``link_bytes_per_node``, ``link_s``, and ``step_s`` = intra-node + max(compute, link).
    """
    cfg, run = split_options(config, options)
    return plan_configs(model, world_size, [cfg], **run)[0]


def split_options(config: Optional[ShardingConfig], options: dict) -> tuple[ShardingConfig, dict]:
    """(the ShardingConfig, the run options) of `plan`'s keywords; unknown names raise PlanError."""
    unknown = sorted(set(options) - _CONFIG_FIELDS - set(_RUN_DEFAULTS))
    if unknown:
        raise PlanError(f"fp.plan: unknown option(s) {unknown}; ShardingConfig fields: {sorted(_CONFIG_FIELDS)}; "
                        f"run options: {sorted(_RUN_DEFAULTS)}")
    fields = {k: v for k, v in options.items() if k in _CONFIG_FIELDS}
    if "mixed_precision" in fields:
        fields["mixed_precision"] = _mixed_precision(fields["mixed_precision"])
    if fields.get("activation_checkpointing") is False:
        fields["activation_checkpointing"] = None
    if config is not None and not isinstance(config, ShardingConfig):
        raise PlanError(f"fp.plan(model, world_size, config): config must be a ShardingConfig, not "
                        f"{type(config).__name__}")
    try:
        cfg = ShardingConfig.from_kwargs(config, **fields)
    except ConfigError as e:
        raise PlanError(str(e)) from e
    return cfg, {**_RUN_DEFAULTS, **{k: v for k, v in options.items() if k in _RUN_DEFAULTS}}


def plan_strategies(model: ModelSource, world_size, strategies: list, **options) -> list:
    """`plan` for several strategies from one fake run (the run does not depend on the strategy)."""
    cfg, run = split_options(options.pop("config", None), options)
    return plan_configs(model, world_size, [dataclasses.replace(cfg, sharding_strategy=s) for s in strategies], **run)


def plan_configs(model: ModelSource, world_size, cfgs: list, **opts) -> list:
    """One Plan per config; the configs share the model's units, precision and activation checkpointing."""
    worlds = sorted({int(world_size)} if isinstance(world_size, int) else {int(w) for w in world_size})
    if not worlds or min(worlds) < 1:
        raise PlanError(f"world_size={world_size!r}: give a positive size or a list of them")
    cp = _context.check(cfgs, worlds, opts)
    mp = cfgs[0].mixed_precision
    ac = cfgs[0].activation_checkpointing
    opt = _optim.check(opts["optimizer"])
    named_gpu = isinstance(opts["calibration"], str) and opts["calibration"] in HARDWARE
    device = torch.device(opts["device"] or ("cuda" if torch.cuda.is_available() or named_gpu else "cpu"))
    tp = _tp.check(opts["tp_size"], opts["tp_plan"], worlds)
    if tp > 1 and (opts["nodes"] is not None or opts["link_latency_us"] is not None):
        raise PlanError("fp.plan: nodes=/link_latency_us= with tp_size are not modelled yet: plan the job's "
                        "data-parallel part on one node (tp_size and world_size only)")
    module = capture(model)
    _quantized.refuse_8bit(module)
    ep, expert_ids, found = _experts.check(cfgs, opts, module)
    if ep > 1 and tp > 1:       # experts whole on every TP rank: the plan without their entries (the base plan too)
        opts["tp_plan"] = _experts.tp_plan(module, found, opts["tp_plan"], ep)
    units, handles = discover_units(module, cfgs[0].auto_wrap_policy, cfgs[0].ignored_modules, mp,
                                    cfgs[0].some_ranks_modules, expert_ids, ep)
    num_params = sum(h.numel for h in handles)
    recorder = None
    if tp > 1:      # flat buffers of local TP tensors (coordinate 0), sharded over dp = world // tp ranks
        recorder = _tp.Recorder(module, _tp.apply(module, handles, tp, opts["tp_plan"]))
    regions = fp32_regions(module, mp)
    ac_policy = _ac_policy(ac, units)
    run_device = device if (device.type != "cuda" or torch.cuda.is_available()) else torch.device("cpu")
    spec = RunSpec(run_device, mp.param_dtype if mp else None, mp.buffer_dtype if mp else None,
                   mp.cast_forward_inputs if mp else False, ac_policy, regions, fp32_buffers(module, mp, regions))
    make_inputs = _remembered(opts["inputs"] or _default_inputs(module, opts["batch_size"], opts["seq_len"]))
    try:
        with _context.routed(module, cp, cfgs[0].context_parallel_attention) as cp_counts, \
                _experts.recorded(found) as routed_rows:
            with _quantized.stand_ins(module):
                tl = run(module, units, handles, spec, make_inputs, opts["loss_fn"])
    finally:
        if recorder is not None:
            recorder.remove()
    tp_wire = recorder.wire(tp) if recorder is not None else ({}, {})
    timed = opts["calibration"] in ("calibrate", True)      # the calibration times the model's own shapes
    cal = _calibration(opts["calibration"], device, mp, LayerSizes.of(module, make_inputs.last, device) if timed
                       else None)
    foreach = device.type == "cuda" if opts["foreach"] is None else opts["foreach"]
    notes = _notes(run_device, device, cfgs[0].cpu_offload) + _ac_notes(ac_policy) + (
        [f"target {device.type} has no device here: activations measured with CPU kernels"]
        if run_device != device else []) + _quantized.notes(module) + _some_ranks_notes(units, handles, cfgs[0]) + \
        _context.notes(cp_counts) + _experts.notes(ep, tp)
    if tp > 1:
        notes.append(f"tensor parallel {tp}: activations, FLOPs and step time are the plain model's (not divided "
                     "by tp, TP traffic unpriced): upper bounds; tp_wire_bytes are the TP dimension's bytes")
    links = Links.of(opts["nodes"], opts["link_gbps"], opts["link_latency_us"])
    out = []
    for cfg in cfgs:
        per_world = {w: _world(w, cfg, units, handles, tl, module, opt, cal, foreach,
                               links.per_node(w) if links else opts["gpus_per_node"], device, links, tp, tp_wire,
                               cp_counts, (ep, routed_rows, found) if ep > 1 else None) for w in worlds}
        if opts["link_latency_us"] is not None:
            _latency.attach(per_world, cfg, opts["gpus_per_node"], device, opts["link_latency_us"])
        if ep > 1:      # the same plan without EP: what gathering the experts whole would move (``_experts.compare``)
            base = plan_configs(module, worlds, [dataclasses.replace(cfg, expert_parallel=None)],
                                **{**opts, "calibration": cal if isinstance(cal, Calibration) else opts["calibration"]})[0]
            for w, p in per_world.items():
                p.expert_parallel.update(_experts.compare(p, base.worlds[w]))
        out.append(Plan(model=_name(model, module), num_params=num_params,
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


def _ac_policy(ac, units) -> Optional[Checkpointing]:
    """The config's activation checkpointing as a `Checkpointing` whose ``modules`` are explicit: "every unit
    but the root" (True, ``modules=None``) becomes exactly the non-root unit modules, as in fp.shard."""
    ac = as_checkpointing(ac)
    if ac is None or ac.modules is not None:
        return ac
    ids = {id(u.module) for u in units[1:]}
    return dataclasses.replace(ac, modules=lambda m: id(m) in ids)


def _ac_notes(ac: Optional[Checkpointing]) -> list:
    if ac is None or (ac.every == 1 and not ac.selective):
        return []
    how = ["selective (matmul/attention outputs kept)"] * ac.selective + [f"every {ac.every}-th module"] * (ac.every > 1)
    return ["activation checkpointing: " + ", ".join(how)]


def _default_inputs(module: nn.Module, batch_size: int, seq_len: int) -> Callable:
    def make():
        args, kwargs = hf_inputs(module, batch_size, seq_len)
        return kwargs if kwargs else args
    return make


class _remembered:
    """``inputs`` keeping the micro-batch it last returned (``last``; None before the first call): the
    calibration reads the batch and sequence length off it."""

    def __init__(self, inputs: Callable):
        self.inputs, self.last = inputs, None

    def __call__(self):
        self.last = self.inputs()
        return self.last


def _world(w, cfg, units, handles, tl, module, opt, cal, foreach, gpus_per_node, device, links=None,
           tp: int = 1, tp_wire: tuple = ({}, {}), cp_counts=None, experts=None) -> WorldPlan:
    from ._world import world_plan
    if tp == 1:
        return world_plan(w, cfg, units, handles, tl, module, opt, cal, foreach, gpus_per_node, device, links,
                          cp_counts, experts)
    # tensor parallel: the engine shards the local TP tensors over the dp ranks (a node holds gpus_per_node / tp);
    # expert parallel lies inside those dp ranks (the EP groups of one TP coordinate, ``_experts/layout.py``)
    out = world_plan(w // tp, cfg, units, handles, tl, module, opt, cal, foreach, max(1, gpus_per_node // tp),
                     device, experts=experts)
    return dataclasses.replace(out, world_size=w, tp_size=tp, tp_wire_bytes=tp_wire[0], tp_wire_calls=tp_wire[1])


def _calibration(calibration, device: torch.device, mp, layer: Optional[LayerSizes] = None):
    """A Calibration, or a function of the world size (named hardware: bandwidth depends on nodes).
    "calibrate" times ``layer``'s shapes (the planned model's; None: the default layer)."""
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
        return calibrate(device, mp.param_dtype if mp and mp.param_dtype else torch.float32, progress=progress,
                         layer=layer)
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


def _some_ranks_notes(units, handles, cfg: ShardingConfig) -> list:
    """What the some-ranks units cost (``_schedule/on_demand.py`` for the default, held when declared)."""
    mp = cfg.mixed_precision
    notes = []
    for u in (u for u in units if u.some_ranks):
        full = sum(handles[i].numel * (mp.param_dtype.itemsize if mp and mp.param_dtype and not handles[i].fp32
                                       else handles[i].dtype.itemsize) for i in u.handles)
        when = ("on demand (fp.shard's default for a modality encoder): only on steps where some rank's inputs "
                "hold its modality; a step without pays none of it" if cfg.some_ranks_modules is None
                else "every step (declared in some_ranks_modules)")
        notes.append(f"{u.name!r} ({type(u.module).__name__}) may run on some ranks only: its full parameters, "
                     f"{full / 1e6:.3g} MB per rank, are held from the root's pre-forward to the end of backward "
                     f"(counted in the peak) {when}; its activations are in the peak only if the planned inputs "
                     f"feed it")
    return notes


def _notes(device: torch.device, target: torch.device, cpu_offload: bool) -> list:
    notes = [f"activations measured by one fake forward+backward on {device.type}; allocator rounding and "
             "fragmentation are not included"]
    if target.type == "cpu":
        notes.append("CPU target: the peak includes the CPU runtime's own heap (kernel caches, a constant measured "
                     "once: WorldPlan.runtime)")
    if cpu_offload:
        notes.append("cpu_offload: shards, gradients and optimizer state are in host memory (host_bytes)")
    return notes
