"""Step time: compute throughput and collective bandwidth, measured (`calibrate`) or named (`HARDWARE`).

predicted step = compute + communication - overlap * min(compute, communication), where
compute = kernels (+ or max) ops * op_overhead_s,
kernels = matmul FLOPs / flops_per_s + attention FLOPs / attention_flops_per_s
          + other bytes / elementwise_bytes_per_s + optimizer bytes / optimizer_bytes_per_s,
communication = wire bytes / bus_bytes_per_s + calls * latency_s.
``overlap`` is 1 where collectives run beside compute (CUDA streams) and 0 where they compete for the same
cores (CPU/gloo). `calibrate` measures the kernel rates on a transformer layer's own kernels (`_workload`),
priced with the fake run's rule, so FLOPs and bytes are divided by rates measured in the same units (a
square-matmul FLOP/s and a streaming ``mul_`` bandwidth under-predicted CPU steps by 15-35%).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from .._comm import collectives as comm
from ._layer_sizes import LayerSizes, fitted


@dataclass(frozen=True)
class Calibration:
    """Throughputs one rank sees. Units: FLOP/s, bytes/s, seconds; ``bus_bytes_per_s`` is per rank, for
    the per-rank ring bytes `fp.comm_stats` counts."""

    flops_per_s: float
    mem_bytes_per_s: float
    bus_bytes_per_s: float
    latency_s: float = 20e-6
    overlap: float = 1.0
    source: str = "assumed"
    op_overhead_s: float = 0.0     # host time per dispatched op (Python + dispatcher + autograd; kernel launch)
    # Bytes/s of the forward/backward ops other than matmul/attention (None: mem_bytes_per_s) and of the
    # optimizer step's traffic (None: mem_bytes_per_s); mem_bytes_per_s is a streaming in-place multiply.
    elementwise_bytes_per_s: Optional[float] = None
    optimizer_bytes_per_s: Optional[float] = None
    attention_flops_per_s: Optional[float] = None   # fused attention kernels (None: flops_per_s)
    # ``fp.Quantization``'s kernels (`_comm/quantized.py`): seconds per element quantized (stochastic
    # rounding) and dequantized, measured on rows beyond the cache (None: from the memory rate, ~6 and 3
    # float32 streaming passes)
    quantize_s_per_elem: Optional[float] = None
    dequantize_s_per_elem: Optional[float] = None
    # cpu_offload (issue 49): pinned host<->device copy bandwidth per direction (None: PCIE_BYTES_PER_S) and the host
    # memory bandwidth the CPU optimizer step streams at (None: HOST_MEMORY_BYTES_PER_S)
    pcie_bytes_per_s: Optional[float] = None
    host_memory_bytes_per_s: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)


# Named hardware for simulation. flops: sustained dense bf16 matmul per GPU (60% of peak: 312 TFLOP/s on A100,
# 989 on H100 SXM); bus: per-GPU ring bus bandwidth of all-gather/reduce-scatter inside a node (NVLink) and across
# nodes (multi-rail: every GPU has its own NIC; the FSDP paper's cluster has 2 Tb/s RoCE per 8-GPU A100 node,
# taken at 75% efficiency); hop_latency_s: per-hop latency, so a ring collective costs (N-1) hops.
HARDWARE = {
    "a100-80gb": dict(flops_per_s=0.6 * 312e12, mem_bytes_per_s=2.0e12, memory=80 * 2**30, gpus_per_node=8,
                      intra_bus_bytes_per_s=230e9, inter_bus_bytes_per_s=0.75 * 2e12 / 8, hop_latency_s=5e-6),
    "h100-80gb": dict(flops_per_s=0.6 * 989e12, mem_bytes_per_s=3.35e12, memory=80 * 2**30, gpus_per_node=8,
                      intra_bus_bytes_per_s=360e9, inter_bus_bytes_per_s=0.75 * 3.2e12 / 8, hop_latency_s=5e-6),
}


# cpu_offload's links (research/cpu-offload.md §2d): pinned copies over PCIe Gen5 x16 measure ~55 GB/s per direction
# (nvbandwidth); a 16-core slice of a DDR5 host streams ~100 GB/s (working assumption; the fused CPU AdamW's rate
# benchmarks/offload_optim_step.py measures is the one to pass as host_memory_bytes_per_s).
PCIE_BYTES_PER_S = 55e9
HOST_MEMORY_BYTES_PER_S = 100e9


def for_hardware(name: str, world: int, overlap: float = 1.0) -> Calibration:
    """Named throughputs at ``world`` GPUs (cross-node bandwidth once the world spans nodes)."""
    hw = HARDWARE[name]
    bus = hw["intra_bus_bytes_per_s"] if world <= hw["gpus_per_node"] else min(hw["intra_bus_bytes_per_s"],
                                                                               hw["inter_bus_bytes_per_s"])
    return Calibration(hw["flops_per_s"], hw["mem_bytes_per_s"], bus, hw["hop_latency_s"] * max(world - 1, 1),
                       overlap, f"named:{name}", op_overhead_s=5e-6)


def default_for(device: torch.device) -> Calibration:
    if device.type == "cuda":
        return for_hardware("a100-80gb", 8)
    return Calibration(20e9, 4e9, 0.5e9, 200e-6, 0.0, "assumed-cpu", op_overhead_s=15e-6,
                       quantize_s_per_elem=5e-9, dequantize_s_per_elem=0.5e-9)


def _timed(fn, min_s: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return dt / n


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(device: Optional[torch.device] = None, dtype: torch.dtype = torch.float32, group=None,
              seconds: float = 0.5, progress=None, layer: Optional[LayerSizes] = None) -> Calibration:
    """Measure, on this process: the kernel rates of a transformer layer's forward+backward and AdamW step in
    ``dtype`` (`_workload`: matmul and attention FLOP/s, other ops' bytes/s, optimizer bytes/s), streaming memory
    bandwidth, host seconds per op and (under an initialized process group) all-gather bandwidth and
    latency. ``layer``: the layer's shapes (None: `LayerSizes.default`; ``LayerSizes.of(model, batch)`` gives a
    model's own, as ``fp.plan`` does); the shapes timed are named in ``source``. ``seconds``: rough budget per
    measurement (the whole call takes ~4x it, and at least 4 replays of the layer: ~4 s for the medium GPT's on
    two CPU cores). Collective: every rank of ``group`` must call it. ``progress(done, total)``, when given,
    after each measurement (``fp.plan`` and ``plan --calibrate`` give rank 0 a
    :class:`fsdp_plugin._progress.Progress` on stderr)."""
    from . import _workload as _workload

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Measure under the host allocator settings fp.shard applies to the step it predicts: with glibc's
        # defaults the workload's freshly allocated outputs page-fault, ~1.4x slower (measured).
        from .._build.host_alloc import keep_freed_host_memory
        keep_freed_host_memory()
    world = comm.group_size(group)
    report = _reporter(progress, group, 4 if world > 1 else 3)
    if world > 1:      # ranks train side by side (sharing memory bandwidth, or cores): measure side by side
        comm.barrier("plan --calibrate", None, group)
    layer = fitted(layer or LayerSizes.default(device), device)   # once: timed and named alike
    rates = _workload.measure(device, dtype, seconds, layer)
    report()
    big = torch.empty(8 * 2**20 if device.type == "cpu" else 64 * 2**20, device=device)
    mem = 2 * big.numel() * big.element_size() / _timed(lambda: (big.mul_(1.0), _sync(device)), seconds / 2)
    report()
    bus, latency = 1e12, 0.0
    if world > 1:
        bus, latency = _measure_collectives(device, group, world, seconds)
        report()
    overlap = 1.0 if device.type == "cuda" else 0.0
    rates.update(mem_bytes_per_s=mem, op_overhead_s=_op_overhead(device, seconds), **_quantization_rates(device))
    if device.type == "cuda":      # cpu_offload's links: pinned copies each way, the host's fused AdamW
        rates.update(offload_rates(device, seconds / 4))
    report()
    if world > 1:
        rates = _group_median(rates, group, device)
    source = f"measured on {device.type}, world {world}, {layer.describe()}"
    return Calibration(rates["flops_per_s"], rates["mem_bytes_per_s"], bus, latency, overlap, source,
                       op_overhead_s=rates["op_overhead_s"],
                       elementwise_bytes_per_s=rates["elementwise_bytes_per_s"],
                       optimizer_bytes_per_s=rates["optimizer_bytes_per_s"],
                       attention_flops_per_s=rates["attention_flops_per_s"],
                       quantize_s_per_elem=rates["quantize_s_per_elem"],
                       dequantize_s_per_elem=rates["dequantize_s_per_elem"],
                       pcie_bytes_per_s=rates.get("pcie_bytes_per_s"),
                       host_memory_bytes_per_s=rates.get("host_memory_bytes_per_s"))


def offload_rates(device, seconds: float, elems: int = 16 * 2**20) -> dict:
    """cpu_offload's rates on this machine: the slower direction of a pinned host<->device copy of ``elems`` fp32
    values (bytes/s), and the host memory rate of torch's fused CPU AdamW step over ``elems`` fp32 parameters (at
    the 28 B/param `_optim.host_step_traffic` counts), the kernel fp.shard gives offloaded AdamW."""
    host = torch.empty(elems, pin_memory=device.type == "cuda")
    dev = torch.empty(elems, device=device)
    nbytes = elems * 4
    h2d = _timed(lambda: (dev.copy_(host, non_blocking=True), _sync(device)), seconds)
    d2h = _timed(lambda: (host.copy_(dev, non_blocking=True), _sync(device)), seconds)
    p = torch.nn.Parameter(torch.zeros(elems))
    p.grad = torch.full((elems,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    step = _timed(opt.step, seconds)
    return {"pcie_bytes_per_s": nbytes / max(h2d, d2h), "host_memory_bytes_per_s": 28 * elems / step}


def _quantization_rates(device) -> dict:
    """Seconds per element of quantizing (stochastic) a 4 M-element row and of dequantizing two such rows summed
    into a float32 buffer (``dequantize_into``, per dequantized element), block 256: the sizes of a unit's
    gradients, beyond the cache (best of 3 after one warm-up)."""
    from .._comm import quantized as qz
    n = 1 << 22
    x = torch.randn(1, n, device=device)
    payload = qz.quantize(torch.randn(2, n, device=device), 256)
    dst = torch.empty(n, device=device)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(3):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return min(times) / n
    return {"quantize_s_per_elem": best(lambda: qz.quantize(x, 256, stochastic=True)),
            "dequantize_s_per_elem": best(lambda: qz.dequantize_into(dst, payload, n, 256)) / 2}


def _reporter(progress, group, total: int):
    """A no-argument callable counting finished measurements into ``progress`` (None: silent)."""
    done = [0]

    def report() -> None:
        done[0] += 1
        if progress is not None:
            progress(done[0], total)
    if progress is not None:
        progress(0, total)
    return report


def _group_median(rates: dict, group, device) -> dict:
    """The median over the group's ranks of every measured value, the same on every rank. Ranks that share cores measure
    at different moments: one may run alone on a core (2x too fast with 4 ranks on 2 cores) or beside a third
    rank (2/3 too slow); the median of the ranks' values is the side-by-side rate training sees, and every rank
    then predicts alike (measured: the minimum over-predicted by 25-35% when one rank was disturbed)."""
    keys = sorted(k for k, v in rates.items() if v is not None)
    mine = torch.tensor([rates[k] for k in keys], dtype=torch.float64, device=device)   # NCCL: device tensors
    everyone = [torch.empty_like(mine) for _ in range(comm.group_size(group))]
    comm.all_gather_list(everyone, mine, group, what="plan --calibrate: every rank's rates")
    return {**rates, **dict(zip(keys, torch.stack(everyone).quantile(0.5, dim=0).tolist()))}


def _op_overhead(device, seconds: float) -> float:
    """Host seconds per aten op of a tiny autograd workload (its arithmetic is negligible)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = torch.randn(8, 8, device=device, requires_grad=True)

    def step():
        y = x
        for _ in range(20):
            y = torch.tanh(y * 1.01 + 0.1)
        y.sum().backward()
        _sync(device)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        step()
    return _timed(step, seconds / 2) / max(Count.n, 1)


def _measure_collectives(device, group, world: int, seconds: float) -> tuple[float, float]:
    elems = (4 if device.type == "cpu" else 64) * 2**20 // world * world
    inp = torch.ones(elems // world, device=device)
    out = torch.empty(elems, device=device)
    tiny = torch.zeros(1, device=device)
    counters = (comm.STATS.calls, comm.STATS.bytes, comm.STATS.intra_node_bytes, comm.STATS.inter_node_bytes)
    before = [dict(c) for c in counters]

    def gather():
        comm.wait(comm.all_gather(out, inp, group, async_op=True, kind="calibrate"))
        _sync(device)

    def ping():
        comm.wait(comm.all_reduce(tiny, group, async_op=True, kind="calibrate"))
        _sync(device)
    steps = max(1, int(seconds / 0.05))
    dt = [None, None]
    for i, fn in enumerate((gather, ping)):
        fn()
        comm.barrier("plan --calibrate", None, group)
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        dt[i] = (time.perf_counter() - t0) / steps
    for counter, old in zip(counters, before):   # not training traffic
        counter["calibrate"] = old.get("calibrate", 0)
        if not counter["calibrate"]:
            del counter["calibrate"]
    latency = dt[1]
    return comm.ring_bytes(elems, 4, world) / max(dt[0] - latency, 1e-9), latency


def quantization_seconds(quantized: int, dequantized: int, cal: Calibration) -> float:
    """Seconds of ``fp.Quantization``'s kernels: measured rates, else streaming passes at the memory rate."""
    q = cal.quantize_s_per_elem if cal.quantize_s_per_elem is not None else 6 * 8 / cal.mem_bytes_per_s
    d = cal.dequantize_s_per_elem if cal.dequantize_s_per_elem is not None else 3 * 8 / cal.mem_bytes_per_s
    return quantized * q + dequantized * d


def optimizer_seconds(optimizer_bytes: int, cal: Calibration) -> float:
    """The device optimizer step: memory-bound, its bytes (``_optim.step_traffic``: bytes per parameter x
    parameters) at the optimizer rate (None: the streaming memory rate, e.g. HBM for named hardware)."""
    return optimizer_bytes / (cal.optimizer_bytes_per_s or cal.mem_bytes_per_s)


def predict(flops: int, other_bytes: int, optimizer_bytes: int, wire_bytes: int, calls: int,
            cal: Calibration, ops: int = 0, attention_flops: int = 0, quantization_s: float = 0.0,
            offload: Optional[dict] = None) -> dict:
    """Seconds per step. ``flops`` includes ``attention_flops``. Host op overhead adds to the kernels where
    they share cores (overlap 0, CPU) and bounds them from below where the host runs ahead of the device
    (overlap 1, CUDA). The optimizer step (``optimizer_s``) follows backward: no collective overlaps it.
    ``offload``: cpu_offload's counted bytes (``offload_seconds``): the step runs on the host instead
    (``optimizer_bytes`` is then the host step's) and the copies' exposed part is added."""
    kernels = ((flops - attention_flops) / cal.flops_per_s
               + attention_flops / (cal.attention_flops_per_s or cal.flops_per_s)
               + other_bytes / (cal.elementwise_bytes_per_s or cal.mem_bytes_per_s)
               + quantization_s)
    host = ops * cal.op_overhead_s
    compute = kernels + host if cal.overlap < 1 else max(kernels, host)
    communication = wire_bytes / cal.bus_bytes_per_s + calls * cal.latency_s
    step = compute + communication - cal.overlap * min(compute, communication)
    out = {"compute_s": compute, "comm_s": communication}
    if offload is None:
        opt_s = optimizer_seconds(optimizer_bytes, cal)
        out["optimizer_s"] = opt_s
    else:
        priced = offload_seconds(offload["h2d_bytes"], offload["d2h_bytes"], optimizer_bytes, cal, compute,
                                 offload.get("h2d_backward_bytes", 0))
        out["offload"] = priced
        out["optimizer_s"] = opt_s = priced["host_step_s"] + priced["exposed_copy_s"]
    out["compute_s"] = compute + out["optimizer_s"]     # compute_s: everything but communication, as before
    out["step_s"] = step + opt_s
    return out


FORWARD_SHARE = 1 / 3     # forward's part of a step's compute (backward: twice forward's FLOPs)


def offload_seconds(h2d_bytes: int, d2h_bytes: int, host_step_bytes: int, cal: Calibration,
                    compute_s: float, h2d_backward_bytes: int = 0) -> dict:
    """cpu_offload's time terms as the engine schedules them (``_flat/offload.py``): host-to-device copies of the
    master shards and device-to-host copies of the reduced gradients each on their own stream, hidden by
    ``cal.overlap`` under the compute of their phase: forward's copies (``h2d_bytes - h2d_backward_bytes``) under
    forward's compute (``FORWARD_SHARE``), backward's (its gathers again, and every gradient, the two directions
    side by side) under backward's; the optimizer step on the host after backward's one wait, serial, at the host
    memory rate."""
    pcie = cal.pcie_bytes_per_s or PCIE_BYTES_PER_S
    host = cal.host_memory_bytes_per_s or HOST_MEMORY_BYTES_PER_S
    h2d_s, d2h_s = h2d_bytes / pcie, d2h_bytes / pcie
    fwd_copies, bwd_copies = (h2d_bytes - h2d_backward_bytes) / pcie, max(h2d_backward_bytes / pcie, d2h_s)
    fwd_compute, bwd_compute = FORWARD_SHARE * compute_s, (1 - FORWARD_SHARE) * compute_s
    exposed = (fwd_copies - cal.overlap * min(fwd_copies, fwd_compute)
               + bwd_copies - cal.overlap * min(bwd_copies, bwd_compute))
    return {"h2d_bytes": h2d_bytes, "d2h_bytes": d2h_bytes, "h2d_backward_bytes": h2d_backward_bytes,
            "h2d_s": h2d_s, "d2h_s": d2h_s,
            "host_step_bytes": host_step_bytes, "host_step_s": host_step_bytes / host, "exposed_copy_s": exposed,
            "pcie_bytes_per_s": pcie, "host_memory_bytes_per_s": host}
