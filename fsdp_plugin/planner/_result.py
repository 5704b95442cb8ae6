"""`Plan`: the planner's answer, per world size, with a breakdown, `to_dict()` and a table when printed."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class WorldPlan:
    """Predictions for one world size; bytes are per rank (every rank holds the same amount)."""

    world_size: int
    param_shards: int          # master parameter shards (padding included)
    grad_shards: int           # sharded gradients after the step's reductions
    optimizer_state: int
    buffers: int
    unsharded_params: int      # the largest set of units unsharded at once (compute dtype)
    unsharded_units: tuple     # which units those are
    activations: int           # peak bytes of forward+backward tensors, measured on fake tensors
    comm_buffers: int          # largest total of unsharded gradients waiting for / inside their reduction
    optimizer_step: int        # temporaries of optimizer.step()
    peak: int                  # the largest sum over the step's timeline (<= the sum of the maxima above)
    peak_at: dict = field(default_factory=dict)   # the categories at the peak moment
    wire_bytes: dict = field(default_factory=dict)  # per step per rank, by collective kind
    wire_calls: dict = field(default_factory=dict)
    step_s: Optional[float] = None
    compute_s: Optional[float] = None
    comm_s: Optional[float] = None
    host_bytes: int = 0        # with cpu_offload: shards, gradients and optimizer state in host memory
    runtime: int = 0           # CPU targets: heap the runtime keeps after the first step (in the peak)
    optimizer_flops: int = 0   # optimizer="muon": the busiest rank's Newton–Schulz FLOPs per step
    # issue 35: hpZ and links (``_links.py``)
    secondary_shards: int = 0  # hpZ: most bytes of secondary shards held between forward and backward (in the peak)
    wire_groups: dict = field(default_factory=dict)   # wire bytes by "kind/group" (shard, replicate, secondary)
    inter_node_bytes: dict = field(default_factory=dict)   # with nodes=: per rank, to other nodes, by kind
    link_bytes_per_node: int = 0   # with nodes=: bytes each node sends on its link per step
    link_s: Optional[float] = None  # with link_gbps=: seconds of link traffic per step
    latency: dict = field(default_factory=dict)   # per-step latency terms at cluster scale (``_latency.py``)
    # issue 31: tensor parallel (``_tp.py``): the bytes above are those of TP coordinate 0's ranks; wire_bytes
    # are the data-parallel dimension's (the engine's collectives, over world_size // tp_size ranks)
    tp_size: int = 1
    tp_wire_bytes: dict = field(default_factory=dict)   # the TP dimension's (torch's own collectives), by kind
    tp_wire_calls: dict = field(default_factory=dict)
    # issue 49: the optimizer step's seconds (device: memory-bound; cpu_offload: the host step plus the copies' part
    # compute does not hide), and cpu_offload's counted bytes and priced seconds (``_time.offload_seconds``)
    optimizer_s: Optional[float] = None
    offload: dict = field(default_factory=dict)
    # issue 54: context parallel (``_context.py``): tokens per rank, the attention's bytes and calls by kind
    context_parallel: dict = field(default_factory=dict)
    # issue 55: expert parallel (``_experts.py``): all-to-all bytes, the experts' collectives with and without EP
    expert_parallel: dict = field(default_factory=dict)

    @property
    def wire_total(self) -> int:
        return sum(self.wire_bytes.values())


@dataclass
class Plan:
    """What `fp.plan` predicts. ``peak_bytes[w]`` is the peak device bytes per rank at world size w."""

    model: str
    num_params: int
    strategy: str
    optimizer: str
    mixed_precision: Optional[str]
    activation_checkpointing: bool
    micro_batch: str
    units: list                    # [{"name", "params", "bytes"}] as fp.shard would build them
    worlds: dict                   # world size -> WorldPlan
    flops_per_step: int
    calibration: dict
    notes: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> dict:
        return {w: p.peak for w, p in self.worlds.items()}

    @property
    def step_time_s(self) -> dict:
        return {w: p.step_s for w, p in self.worlds.items()}

    @property
    def wire_bytes(self) -> dict:
        return {w: p.wire_total for w, p in self.worlds.items()}

    def to_dict(self) -> dict:
        d = asdict(self)
        d["worlds"] = {str(w): {**asdict(p), "unsharded_units": list(p.unsharded_units)}
                       for w, p in self.worlds.items()}
        d["peak_bytes"] = {str(w): v for w, v in self.peak_bytes.items()}
        return d

    def __str__(self) -> str:
        ws = sorted(self.worlds)
        head = (f"{self.model}: {self.num_params:,} parameters in {len(self.units)} units, {self.strategy}, "
                f"{self.optimizer}, mixed precision {self.mixed_precision or 'off'}, activation checkpointing "
                f"{'on' if self.activation_checkpointing else 'off'}, micro-batch {self.micro_batch}")
        rows = [("parameter shards", "param_shards"), ("gradient shards", "grad_shards"),
                ("optimizer state", "optimizer_state"), ("buffers", "buffers"),
                ("unsharded units (max)", "unsharded_params"), ("activations (peak)", "activations"),
                ("reduction buffers (max)", "comm_buffers"), ("optimizer step temps", "optimizer_step"),
                ("CPU runtime state", "runtime"),
                ("PEAK per rank", "peak")]
        width = 16
        lines = [head, f"{'per rank':<26}" + "".join(f"{'world ' + str(w):>{width}}" for w in ws)]
        if not any(self.worlds[w].runtime for w in ws):
            rows.remove(("CPU runtime state", "runtime"))
        for label, attr in rows:
            lines.append(f"{label:<26}" + "".join(f"{fmt_bytes(getattr(self.worlds[w], attr)):>{width}}" for w in ws))
        lines.append(f"{'wire bytes / step':<26}" + "".join(f"{fmt_bytes(self.worlds[w].wire_total):>{width}}"
                                                           for w in ws))
        if all(self.worlds[w].context_parallel for w in ws):     # issue 54: the split attention's share
            lines.append(f"{'CP tokens per rank':<26}" + "".join(
                f"{self.worlds[w].context_parallel['tokens_per_rank']:>{width},}" for w in ws))
            lines.append(f"{'CP bytes / layer forward':<26}" + "".join(
                f"{fmt_bytes(self.worlds[w].context_parallel['layer_forward_bytes']):>{width}}" for w in ws))
            lines.append(f"{'CP attention bytes / step':<26}" + "".join(
                f"{fmt_bytes(self.worlds[w].context_parallel['attention_bytes']):>{width}}" for w in ws))
        if all(self.worlds[w].expert_parallel for w in ws):      # issue 55: EP against gathering the experts
            ep = {w: self.worlds[w].expert_parallel for w in ws}
            for label, key in (("EP all-to-all / step", "all_to_all_bytes"),
                               ("experts' collectives (EP)", "expert_collective_bytes"),
                               ("experts' (without EP)", "expert_collective_bytes_without_ep"),
                               ("wire bytes without EP", "wire_bytes_without_ep"),
                               ("PEAK per rank without EP", "peak_without_ep"),
                               ("EP receive buffer (worst)", "recv_buffer_worst_bytes")):
                lines.append(f"{label:<26}" + "".join(f"{fmt_bytes(ep[w][key]):>{width}}" for w in ws))
            lines.append(f"{'EP moves fewer bytes':<26}" + "".join(
                f"{'yes' if ep[w]['recommend'] else 'no':>{width}}" for w in ws))
        if any(self.worlds[w].tp_size > 1 for w in ws):     # issue 31: the TP dimension's (torch's collectives)
            lines.append(f"{'TP wire bytes / step':<26}" + "".join(
                f"{fmt_bytes(sum(self.worlds[w].tp_wire_bytes.values())):>{width}}" for w in ws))
        if all(self.worlds[w].step_s is not None for w in ws):
            lines.append(f"{'step time (predicted)':<26}" + "".join(f"{self.worlds[w].step_s * 1e3:>{width - 3}.1f} ms"
                                                                   for w in ws))
        if all(self.worlds[w].offload for w in ws):     # cpu_offload: PCIe each way and the host step
            lines.append(f"{'offload PCIe h2d / d2h':<26}" + "".join(
                f"{fmt_bytes(self.worlds[w].offload['h2d_bytes']) + ' / ' + fmt_bytes(self.worlds[w].offload['d2h_bytes']):>{width + 8}}"
                for w in ws))
            if all("host_step_s" in self.worlds[w].offload for w in ws):
                lines.append(f"{'offload host step':<26}" + "".join(
                    f"{self.worlds[w].offload['host_step_s'] * 1e3:>{width - 3}.1f} ms" for w in ws))
        if all(self.worlds[w].latency for w in ws):
            lines.append(f"{'collectives / step':<26}" + "".join(
                f"{self.worlds[w].latency['unit_collectives'] + self.worlds[w].latency['control_collectives']:>{width}}"
                for w in ws))
            lines.append(f"{'blocking waits / step':<26}" + "".join(
                f"{self.worlds[w].latency['host_blocking_waits']:>{width}}" for w in ws))
            lines.append(f"{'latency floor':<26}" + "".join(
                f"{self.worlds[w].latency['latency_floor_s'] * 1e3:>{width - 3}.1f} ms" for w in ws))
            lines.append(f"{'store ops/s (all ranks)':<26}" + "".join(
                f"{self.worlds[w].latency['store_ops_per_s_total']:>{width}.0f}" for w in ws))
            lines.append(f"latency floor: ring steps x {self.worlds[ws[0]].latency['link_latency_us']:.0f} us per hop "
                         "(fp.plan(..., link_latency_us=...)); a lower bound for NCCL's trees")
        lines.append(f"step time from {self.calibration.get('source', '?')} throughputs; "
                     f"{self.flops_per_step / 1e9:,.1f} GFLOP per rank per step")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
