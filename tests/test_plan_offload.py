"""fp.plan prices cpu_offload (issue 49): PCIe bytes each way (counted by the replay, equal to what the engine's
copier counts), the host optimizer step's bytes (fused kernel), their seconds at named bandwidths, and the device
optimizer step as a memory-bound term after backward."""
import pytest
import torch

import fsdp_plugin as fp
from fsdp_plugin._flat import offload
from fsdp_plugin.testing import fake
from fsdp_plugin.planner import Calibration
from fsdp_plugin.planner._time import HOST_MEMORY_BYTES_PER_S, PCIE_BYTES_PER_S, offload_seconds, predict
from models import GPT, Block, gpt_batch

BF16 = fp.MixedPrecision(param_dtype=torch.bfloat16)
CAL = Calibration(flops_per_s=1e12, mem_bytes_per_s=1e11, bus_bytes_per_s=1e10, overlap=1.0)


def _plan(**kw):
    return fp.plan(lambda: GPT(), world_size=1, auto_wrap_policy={Block}, optimizer="adamw",
                   inputs=lambda: gpt_batch(0, 0), loss_fn=None, calibration=CAL, **kw).worlds[1]


def _fused_step_bytes_per_elem(name: str) -> int:
    """Bytes per parameter element torch's fused CPU kernel streams in one step, read from the kernel itself: a
    real fused step under a dispatch mode, every per-element operand of the ``_fused_*_`` op counted once read
    and once more when the kernel changed it (an oracle independent of the planner's table)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    n = 1000
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.ones(n)
    opt, counted = _MAKE[name]([p], fused=True), []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.__name__.startswith("_fused_"):
                return func(*args, **(kwargs or {}))
            operands = [t for v in args for t in (v if isinstance(v, (list, tuple)) else [v])
                        if isinstance(t, torch.Tensor) and t.numel() == n]
            before = [t.clone() for t in operands]
            out = func(*args, **(kwargs or {}))
            # the schema marks grads mutable too (for an in-kernel unscale): count what the kernel changed
            counted.extend(t.element_size() * (1 + (not torch.equal(t, b))) for t, b in zip(operands, before))
            return out
    opt.step()                     # the first step creates state (momentum buffers) outside the fused op
    with Count():
        opt.step()
    assert counted, f"{name}: no fused kernel ran"
    return sum(counted)


def _loop_step_bytes_per_elem(name: str) -> int:
    """Bytes per parameter element torch's one-tensor-at-a-time step streams, read from its kernels: every aten op
    of a real step (foreach=False) counts each distinct per-element operand it reads once and each tensor it
    returns (written) once."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    n = 1000
    p = torch.zeros(n, requires_grad=True)
    p.grad = torch.ones(n)
    opt = _MAKE[name]([p], foreach=False)
    total = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            reads = {id(t): t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor) and t.numel() == n}
            out = func(*args, **(kwargs or {}))
            writes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.numel() == n]
            total.append(sum(t.nbytes for t in reads.values()) + sum(t.nbytes for t in writes))
            return out
    opt.step()                     # the first step creates state outside the update
    with Count():
        opt.step()
    return sum(total) // n


_MAKE = {"adamw": lambda q, **kw: torch.optim.AdamW(q, lr=1e-3, **kw),
         "adam": lambda q, **kw: torch.optim.Adam(q, lr=1e-3, **kw),
         "sgd": lambda q, **kw: torch.optim.SGD(q, lr=0.1, **kw),
         "sgd-momentum": lambda q, **kw: torch.optim.SGD(q, lr=0.1, momentum=0.9, **kw)}


@pytest.mark.parametrize("name", list(_MAKE))
def test_planned_optimizer_step_bytes_are_torchs_kernels(name):
    """The planner's per-element step traffic, device (torch's loop) and host (the fused CPU kernel offload
    picks), against what torch's kernels read and write."""
    from fsdp_plugin.planner._optim import host_step_traffic, step_traffic
    assert host_step_traffic(name, 1) == _fused_step_bytes_per_elem(name)
    assert step_traffic(name, 1) == _loop_step_bytes_per_elem(name)


def _engine_step_bytes(monkeypatch, **kw):
    """The copier's counted bytes of one training step (the second: the first allocates), on CPU."""
    monkeypatch.setattr(offload, "for_config", fake.offloading_for_config())
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, cpu_offload=True, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = model._fp_root.offload.stats
    for s in range(2):
        stats.reset()
        loss = model(*gpt_batch(s, 0))
        forward = stats.h2d_bytes
        opt.zero_grad()
        loss.backward()
        opt.step()
    trainable = sum(h.chunk for u in model._fp_root.units for h in u.handles if h.requires_grad)
    return stats.h2d_bytes, stats.d2h_bytes, trainable, stats.h2d_bytes - forward


@pytest.mark.parametrize("mp", [None, BF16], ids=["fp32", "bf16"])
def test_planned_pcie_bytes_are_the_engines(monkeypatch, mp):
    kw = {} if mp is None else {"mixed_precision": mp}
    h2d, d2h, trainable, h2d_backward = _engine_step_bytes(monkeypatch, **kw)
    plan = _plan(cpu_offload=True, **kw)
    assert (plan.offload["h2d_bytes"], plan.offload["d2h_bytes"]) == (h2d, d2h)
    assert plan.offload["h2d_backward_bytes"] == h2d_backward > 0, "backward gathers the resharded units again"
    assert d2h == 4 * trainable, "fp32 gradients, once each"
    assert h2d > d2h, "resharded units are copied again for backward (fp32 masters cross PCIe, as FSDP2's)"
    assert plan.offload["host_step_bytes"] == _fused_step_bytes_per_elem("adamw") * trainable


def test_offload_seconds_default_and_overridden_bandwidths():
    t = offload_seconds(55 * 10**9, 11 * 10**9, 28 * 10**9, CAL, compute_s=0.5)
    assert t["h2d_s"] == pytest.approx(55e9 / PCIE_BYTES_PER_S) and t["d2h_s"] == pytest.approx(0.2)
    assert t["host_step_s"] == pytest.approx(28e9 / HOST_MEMORY_BYTES_PER_S)
    assert t["exposed_copy_s"] == pytest.approx(1.0 - 0.5 / 3), "forward's copies beyond forward's compute"
    t = offload_seconds(55 * 10**9, 11 * 10**9, 0, CAL, compute_s=3.0, h2d_backward_bytes=22 * 10**9)
    assert t["exposed_copy_s"] == pytest.approx((0.6 - 0.6) + (0.4 - 0.4)), "each phase's copies hidden by its compute"
    t = offload_seconds(55 * 10**9, 33 * 10**9, 0, CAL, compute_s=0.6, h2d_backward_bytes=22 * 10**9)
    assert t["exposed_copy_s"] == pytest.approx((0.6 - 0.2) + (0.6 - 0.4)), "backward: both directions side by side"
    own = Calibration(**{**CAL.to_dict(), "pcie_bytes_per_s": 25e9, "host_memory_bytes_per_s": 50e9})
    t = offload_seconds(50 * 10**9, 0, 100 * 10**9, own, compute_s=0.0)
    assert (t["h2d_s"], t["host_step_s"], t["exposed_copy_s"]) == pytest.approx((2.0, 2.0, 2.0))


def test_plan_prices_the_host_step_instead_of_the_device_step():
    on, off = _plan(cpu_offload=True), _plan()
    per_elem = _loop_step_bytes_per_elem("adamw") / _fused_step_bytes_per_elem("adamw")   # torch's kernels
    assert off.offload == {} and off.optimizer_s == pytest.approx(per_elem * on.offload["host_step_bytes"] / 1e11)
    o = on.offload
    assert on.optimizer_s == pytest.approx(o["host_step_s"] + o["exposed_copy_s"])
    assert on.step_s == pytest.approx(on.compute_s, rel=1e-9), "world 1: compute (the optimizer term included)"
    assert on.step_s - on.optimizer_s >= off.step_s - off.optimizer_s, "plus the engine's copies of the masters"
    assert "offload PCIe h2d / d2h" in str(fp.plan(lambda: GPT(), world_size=[1, 2], auto_wrap_policy={Block},
                                                  inputs=lambda: gpt_batch(0, 0), loss_fn=None, calibration=CAL,
                                                  cpu_offload=True))


def test_device_optimizer_step_is_memory_bound_and_follows_backward():
    """bytes per parameter x parameters / memory rate, added after compute and communication overlap (no
    collective runs beside the step)."""
    cal = Calibration(flops_per_s=1e12, mem_bytes_per_s=4.8e12, bus_bytes_per_s=1e11, overlap=1.0)
    adamw_llama_1b = 80 * 1_235_814_400
    t = predict(10**12, 0, adamw_llama_1b, 2 * 10**11, 0, cal)
    assert t["optimizer_s"] == pytest.approx(adamw_llama_1b / 4.8e12)
    assert t["step_s"] == pytest.approx(max(1.0, 2.0) + t["optimizer_s"])
    own = Calibration(**{**cal.to_dict(), "optimizer_bytes_per_s": 2.4e12})
    assert predict(0, 0, adamw_llama_1b, 0, 0, own)["optimizer_s"] == pytest.approx(2 * t["optimizer_s"])


def test_offload_rates_are_measured_here():
    """What ``calibrate`` measures on CUDA for cpu_offload (run here on CPU: the same code, unpinned)."""
    from fsdp_plugin.planner._time import offload_rates
    r = offload_rates(torch.device("cpu"), 0.01, elems=2**18)
    assert r["pcie_bytes_per_s"] > 0 and r["host_memory_bytes_per_s"] > 0
    cal = Calibration(**{**CAL.to_dict(), **r})
    assert offload_seconds(10**9, 0, 28 * 10**6, cal, 0.0)["host_step_s"] == pytest.approx(
        28e6 / r["host_memory_bytes_per_s"])
