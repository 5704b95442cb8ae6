"""One world size's numbers: static bytes, the schedule replay, wire bytes and step time."""
from __future__ import annotations

from .._groups.mesh import mesh_dims
from .._build.strategy import STRATEGIES
from ._muon import muon_step
from ..config import ShardingConfig
from . import _optim as _optim
from ._replay import Layout, replay
from ._result import WorldPlan
from ._time import predict, quantization_seconds
from ._links import price
from . import _experts
from ._context import check_shard, summary
from ._units import buffer_bytes
from . import _quantized


def layout_for(world: int, cfg: ShardingConfig, gpus_per_node: int, device=None) -> Layout:
    """Shard/replicate sizes from the engine's mesh rule (hybrid: one node of ``gpus_per_node`` ranks shards).
    ``device`` cpu means gloo, whose collectives take the engine's point-to-point path (its in-flight bytes:
    `_collectives.inflight_host_bytes`); NCCL writes in place."""
    mesh = cfg.device_mesh if isinstance(cfg.device_mesh, tuple) else None
    shard, rep = mesh_dims(STRATEGIES[cfg.sharding_strategy].scope, world, min(world, gpus_per_node), mesh)
    return Layout(cfg, world, shard, rep, staging=getattr(device, "type", None) == "cpu", per_node=gpus_per_node)


# Heap the CPU runtime allocates during the first training step and keeps (kernel, dispatcher and autograd
# caches: no tensor), measured once with the exact-heap tracker on GPT small (benchmarks/plan_accuracy.py,
# "runtime" column, torch 2.13 CPU, gloo, engine with one autograd node per unit): 3.7 MiB with fp32 kernels,
# 10.0 MiB once bf16/fp16 kernels run. A constant of the CPU runtime, not of the model; CUDA device memory has
# no such term (host memory only).
CPU_RUNTIME_BYTES = {"fp32": int(3.7 * 2**20), "low_precision": int(10.0 * 2**20)}


def runtime_bytes(device, lay: Layout, handles) -> int:
    """The CPU runtime's own heap (see CPU_RUNTIME_BYTES) for a CPU target, else 0."""
    if getattr(device, "type", None) != "cpu":
        return 0
    low = any(lay.compute(h).is_floating_point and lay.compute(h).itemsize < 4 for h in handles)
    return CPU_RUNTIME_BYTES["low_precision" if low else "fp32"]


def world_plan(world: int, cfg: ShardingConfig, units, handles, tl, module, opt: str, cal,
               foreach: bool, gpus_per_node: int, device=None, links=None, cp_counts=None,
               experts=None) -> WorldPlan:
    """``cp_counts``: the context-parallel run's counters (``_context.py``); ``experts``: ``(E, Recorder, experts
    modules)`` under expert_parallel (``_experts.py``)."""
    lay = layout_for(world, cfg, gpus_per_node, device)
    s = lay.shard_size
    check_shard(cfg.context_parallel, cfg, s, world)
    if experts is not None:
        _experts.check_shard(experts[0], s, world, cfg.sharding_strategy)
    param_shards = sum(h.chunk(lay.n(h)) * h.dtype.itemsize for h in handles)
    trainable = sum(h.chunk(lay.n(h)) * h.dtype.itemsize for h in handles if h.requires_grad)
    trainable_elems = sum(h.chunk(lay.n(h)) for h in handles if h.requires_grad)
    largest = max((-(-h.largest // lay.n(h)) * h.dtype.itemsize for h in handles if h.requires_grad), default=0)
    opt_state = _optim.state_bytes(opt, trainable)
    step_temps = _optim.step_temporaries(opt, trainable, largest, foreach)
    buffers = buffer_bytes(module, cfg.mixed_precision.buffer_dtype if cfg.mixed_precision else None)
    buffers += _quantized.state_bytes(module)     # 4-bit quant_state: whole on every rank, as buffers are
    on_device = 0 if cfg.cpu_offload else param_shards + opt_state
    runtime = runtime_bytes(device, lay, handles)
    res = replay(units, handles, tl, lay, on_device + buffers + tl.input_bytes + runtime,
                 0 if cfg.cpu_offload else step_temps)
    if cp_counts is not None:      # the context-parallel attention's collectives, by the kinds fp.comm_stats uses
        res.wire.update(cp_counts.bytes)
        res.calls.update(cp_counts.calls)
    ep_summary = {}
    if experts is not None:        # the experts' all-to-alls at uniform routing (``_experts.py``)
        a2a = _experts.all_to_all(experts[1], experts[0])
        ep_summary = _experts.summary(experts[1], experts[0], experts[2], res, handles, lay, a2a)
        res.wire.update(a2a[0])
        res.calls.update(a2a[1])
    p = res.peak
    ns_flops = _muon_into(res, handles, s) if opt == "muon" else 0
    cal_w = cal(world) if callable(cal) else cal
    n_tensors = sum(len(h.param_ids) for h in handles if h.requires_grad)
    ops = tl.ops + _optim.step_ops(opt, n_tensors, foreach)
    # cpu_offload (issue 49): the copies the replay counted, and the optimizer step on the host (fused kernel)
    offload = ({"h2d_bytes": res.h2d_bytes, "d2h_bytes": res.d2h_bytes, "h2d_backward_bytes": res.h2d_backward_bytes}
               if cfg.cpu_offload else None)
    opt_bytes = (_optim.host_step_traffic(opt, trainable_elems) if cfg.cpu_offload
                 else _optim.step_traffic(opt, trainable_elems))
    t = predict(tl.flops + ns_flops, tl.other_bytes + res.engine_bytes, opt_bytes,
                sum(res.wire.values()), sum(res.calls.values()), cal_w, ops, tl.attention_flops,
                quantization_seconds(res.quantized_elems, res.dequantized_elems, cal_w),
                offload=offload) if cal_w is not None else {}
    across = {}
    if links is not None:      # nodes and a link: each collective at the link its group uses
        across = price(links, world, lay, res, t.get("compute_s") or 0.0,
                       cal_w.bus_bytes_per_s if cal_w else float("inf"), cal_w.latency_s if cal_w else 0.0,
                       cal_w.overlap if cal_w else 1.0)
        t = {**t, **{k: across[k] for k in ("step_s", "comm_s") if k in across}}
    return WorldPlan(world_size=world, param_shards=param_shards, grad_shards=trainable, optimizer_state=opt_state,
                     buffers=buffers, unsharded_params=res.max_unsharded, unsharded_units=res.max_unsharded_units,
                     activations=tl.act_peak, comm_buffers=res.max_reducing, optimizer_step=step_temps,
                     peak=p.total, peak_at={"static": p.static - runtime, "runtime": runtime, "unsharded": p.unsharded, "reducing": p.reducing,
                                            "grad_shards": p.grad_shards, "activations": p.activations,
                                            "unsharded_units": list(p.unsharded_units)},
                     wire_bytes=dict(res.wire), wire_calls=dict(res.calls), step_s=t.get("step_s"),
                     compute_s=t.get("compute_s"), comm_s=t.get("comm_s"), optimizer_s=t.get("optimizer_s"),
                     offload=t.get("offload") or ({**offload, "host_step_bytes": opt_bytes} if offload else {}),
                     host_bytes=(param_shards + opt_state + trainable) if cfg.cpu_offload else 0,
                     runtime=runtime, optimizer_flops=ns_flops, secondary_shards=res.max_secondary,
                     wire_groups={f"{k}/{g}": v for (k, g), v in res.wire_groups.items()},
                     inter_node_bytes=across.get("inter_node_bytes", {}),
                     link_bytes_per_node=across.get("link_bytes_per_node", 0), link_s=across.get("link_s"),
                     context_parallel=summary(cp_counts, world), expert_parallel=ep_summary)


def _muon_into(res, handles, shard_size: int) -> int:
    """Add fp.optim.Muon's owner exchange (the busiest rank's bytes) to the replay's wire counts; return the
    busiest rank's Newton–Schulz FLOPs."""
    sent, flops, calls = muon_step([h.shapes for h in handles if h.requires_grad], shard_size)
    if calls:
        res.wire["optim_exchange"] = max(sent)
        res.calls["optim_exchange"] = calls
    return max(flops)
