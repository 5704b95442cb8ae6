"""Quantized collectives (``fp.Quantization``, ``_comm/quantized.py``): the error bounds the scheme predicts,
asserted against the exact values, and the bytes they save, asserted from ``fp.comm_stats``."""
import pytest
import torch
import torch.distributed as dist

import fsdp_plugin as fp
from _dist import run_ranks
from _parity import make_optimizer, train
from fsdp_plugin._comm import collectives as comm
from fsdp_plugin._comm import quantized as qz
from models import GPT, Block, gpt_batch

BLOCK = 64
# float32 arithmetic of code·scale: a relative term on top of scale/2
SLACK = 1e-6


def _bound_ok(err: torch.Tensor, bound: torch.Tensor, exact: torch.Tensor) -> bool:
    return bool((err <= bound * (1 + SLACK) + exact.abs() * 2e-7 + 1e-12).all())


QMAX = {"int8": 127, "int4": 7}
# fewer bytes than float32 at BLOCK, scales included: 3.76x and 7.11x in whole blocks (6.94x for int4 on the
# reduce-scatter's 1,000-element rows, whose last block is padded)
RATIO = {"int8": 3.5, "int4": 6.9}


def _block_scales(rows: torch.Tensor, block: int, qmax: int = 127) -> torch.Tensor:
    """The scale of the block each element of ``rows`` (R, L) falls in, elementwise (R, L)."""
    r, length = rows.shape
    nb = qz.blocks(length, block)
    x = torch.nn.functional.pad(rows.float(), (0, nb * block - length)).view(r, nb, block)
    s = x.abs().amax(-1, keepdim=True) / qmax
    return s.expand(r, nb, block).reshape(r, nb * block)[:, :length]


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantize_round_trip_within_half_a_step(fmt):
    torch.manual_seed(0)
    bits, qmax = qz.BITS[fmt], QMAX[fmt]
    x = torch.randn(3, 1000) * torch.logspace(-4, 2, 1000)
    x[1, :BLOCK] = 0                                  # an all-zero block: scale 0, exact zeros
    payload = qz.quantize(x, BLOCK, bits=bits)
    assert payload.dtype == torch.int8 and payload.shape == (3, qz.payload_elems(1000, BLOCK, bits))
    assert qz.payload_elems(1000, BLOCK, bits) == 16 * (BLOCK * bits // 8 + 4)
    back = qz.dequantize(payload, 1000, BLOCK, bits)
    half = _block_scales(x, BLOCK, qmax) / 2
    assert torch.equal(qz.scales(payload, 1000, BLOCK, bits), _block_scales(x, BLOCK, qmax)[:, ::BLOCK])
    assert _bound_ok((back - x).abs(), half, x)
    assert torch.equal(back[1, :BLOCK], torch.zeros(BLOCK))
    assert (back - x).abs().max() > 0                 # it does quantize
    # the bound is tight where it should be: some element lands near half a step away
    assert ((back - x).abs() / half.clamp_min(1e-30)).max() > 0.9


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_dequantization_equals_the_reference_bit_for_bit(fmt, dtype, monkeypatch):
    """The waits' tiled kernels (`dequantize_into`: the rows' float32 sum in row order, one row exact;
    `dequantize_rows_into`: each row into its own, strided destination) give `dequantize`'s values exactly, across
    tile edges, a padded last block and a destination shorter than the row."""
    monkeypatch.setattr(qz, "_TILE_ELEMS_CPU", 4 * BLOCK)          # many tiles on small rows
    torch.manual_seed(0)
    bits, n = qz.BITS[fmt], 37 * BLOCK + 5
    x = torch.randn(3, n)
    payload = qz.quantize(x, BLOCK, stochastic=True, bits=bits)
    ref = qz.dequantize(payload, n, BLOCK, bits)
    out = torch.empty(n, dtype=dtype)
    qz.dequantize_into(out, payload, n, BLOCK, bits)
    assert torch.equal(out, (torch.zeros(n) + ref[0] + ref[1] + ref[2]).to(dtype))
    qz.dequantize_into(out, payload, n, BLOCK, bits, own=x[1], me=1)
    assert torch.equal(out, (torch.zeros(n) + ref[0] + x[1] + ref[2]).to(dtype))
    short = torch.empty(n - 9, dtype=dtype)
    qz.dequantize_into(short, payload[2:], n, BLOCK, bits)
    assert torch.equal(short, ref[2, :n - 9].to(dtype))
    wide = torch.zeros(3, n + 3, dtype=dtype)
    qz.dequantize_rows_into(wide[:, :n], payload, n, BLOCK, bits)
    assert torch.equal(wide[:, :n], ref.to(dtype)) and not wide[:, n:].any()


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stochastic_rounding_is_unbiased_and_within_one_step(fmt):
    """Gradients round stochastically: each error below one step, the mean error over many roundings ≈ 0
    (round-to-nearest fails this: its error is the same every time, up to half a step)."""
    torch.manual_seed(0)
    bits = qz.BITS[fmt]
    x = torch.randn(1, 4096) * torch.logspace(-3, 1, 4096)
    step = _block_scales(x, BLOCK, QMAX[fmt])
    trials = torch.stack([qz.dequantize(qz.quantize(x, BLOCK, stochastic=True, bits=bits), 4096, BLOCK, bits)
                          for _ in range(400)])
    assert _bound_ok((trials - x).abs().amax(0), step, x)
    mean_err = (trials.mean(0) - x).abs()
    assert bool((mean_err <= 6 * step / (2 * 400 ** 0.5) + 1e-12).all()), (mean_err / step).max()
    nearest = (qz.dequantize(qz.quantize(x, BLOCK, bits=bits), 4096, BLOCK, bits) - x).abs()
    assert (nearest > 6 * step / (2 * 400 ** 0.5)).any()        # the check above can fail



@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_stochastic_rounding_keeps_values_far_below_one_step(fmt):
    """Values of 1/1000 of a step (one large gradient sets each block's scale) survive on average: the dither
    has 16 random bits, so they round up one time in ~1,000 (a floor without noise, or an 8-bit dither whose
    grid is 1/256, loses them every time: the bias round-to-nearest has, which Adam amplifies)."""
    bits, qmax = qz.BITS[fmt], QMAX[fmt]
    x = torch.full((1, 4096), 1e-3)
    x[0, ::BLOCK] = qmax                     # every block's scale is 1.0
    small = torch.ones(4096, dtype=torch.bool)
    small[::BLOCK] = False
    got = torch.stack([qz.dequantize(qz.quantize(x, BLOCK, stochastic=True, bits=bits), 4096, BLOCK, bits)[0]
                       for _ in range(200)])
    assert bool((got[:, ~small] == qmax).all())
    mean = got[:, small].mean().item()      # 806,400 samples: the mean's sd is ~3.5e-5, 3.5% of 1e-3
    assert abs(mean - 1e-3) < 2e-4, mean

def test_config_validation():
    q = fp.Quantization(weights="int8", gradients="int8")
    assert q.block_size == 256 and fp.ShardingConfig(quantization=q).quantization is q
    for bad in ({"weights": "int4"}, {"gradients": True}, {"block_size": 100}, {"block_size": 0}):
        with pytest.raises(fp.ConfigError):
            fp.Quantization(**bad)
    with pytest.raises(fp.ConfigError, match="no_shard never all-gathers"):
        fp.ShardingConfig(sharding_strategy="no_shard", quantization=fp.Quantization(weights="int8"))
    with pytest.raises(fp.ConfigError, match="fp.Quantization"):
        fp.ShardingConfig(quantization="int8")
    fp.ShardingConfig(sharding_strategy="no_shard", quantization=fp.Quantization(gradients="int8"))
    assert fp.Quantization(gradients="int4").gradients == "int4"
    with pytest.raises(fp.ConfigError, match="gradients only"):
        fp.Quantization(weights="int4")


def _gathered(rank, world, strategy, mesh, dtype, block):
    torch.manual_seed(0)
    model = GPT()
    mp = fp.MixedPrecision(param_dtype=dtype) if dtype is not None else None
    q = fp.Quantization(weights="int8", block_size=block)
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, device_mesh=mesh, mixed_precision=mp,
             quantization=q)
    out = []
    fp.comm_stats.reset()
    for u in model._fp_root.units:
        for h in u.handles:
            master = h.gather_master()            # exact, kind state_dict
            h.unshard(async_op=False)
            h.wait_unshard()
            out.append((master, h._full.detach().clone(), h.mesh.shard_size))
            h.reshard()
    return out, dict(fp.comm_stats.bytes)


@pytest.mark.parametrize("strategy,mesh,world,dtype", [
    ("full_shard", None, 2, None), ("shard_grad_op", None, 3, None), ("hybrid_shard", (2, 2), 4, None),
    ("full_shard", None, 2, torch.bfloat16)])
def test_gathered_weights_within_half_a_step(strategy, mesh, world, dtype):
    """qwZ: every gathered weight within its block's scale/2 of the master, the same copy on every rank, and
    the bytes from comm_stats: int8 + scales, ≥ 3.5× fewer than float32 (≥ 1.9× than bf16)."""
    block = 256                                     # the default: the byte ratios below need it
    results = run_ranks(_gathered, world, strategy, mesh, dtype, block)
    first, stats = results[0]
    for other, _ in results[1:]:
        for (_, full0, _), (_, full, _) in zip(first, other):
            assert torch.equal(full0, full), "ranks gathered different weights"
    exact_bytes = 0
    for master, full, n in first:
        rows = master.view(n, -1)
        half = _block_scales(rows, block).reshape(-1) / 2
        err = (full.float() - master.float()).abs()
        extra = master.float().abs() * 2 ** -8 if dtype is torch.bfloat16 else 0   # the cast to bf16 after
        assert _bound_ok(err, half + extra, master)
        assert err.max() > 0
        exact_bytes += master.numel() * (dtype or torch.float32).itemsize * (n - 1) // n
    assert "all_gather" not in stats
    ratio = exact_bytes / stats[qz.WEIGHTS_KIND]
    assert ratio >= (1.9 if dtype is torch.bfloat16 else 3.5), ratio


def _reduced(rank, world, rows_per_rank, group_of, fmt):
    """Every rank's gradient is ``torch.randn`` of seed (rank, 1); reduce it quantized and exactly."""
    groups = [dist.new_group(g) for g in group_of]
    mine = [g for g, ranks in zip(groups, group_of) if rank in ranks][0]
    n = dist.get_world_size(mine)
    grad = _grad_of(rank, n * rows_per_rank)
    q = fp.Quantization(gradients=fmt, block_size=BLOCK)
    fp.comm_stats.reset()
    out = torch.empty(rows_per_rank)
    comm.wait(qz.reduce_scatter(q, out, grad.clone(), mine), "test")
    exact = torch.empty(rows_per_rank)
    dist.reduce_scatter_tensor(exact, grad.clone(), group=mine)
    return out, exact, dict(fp.comm_stats.bytes)


def _grad_of(rank, numel):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)


@pytest.mark.parametrize("world,groups,fmt", [(2, [[0, 1]], "int8"), (4, [[0, 1, 2, 3]], "int8"),
                                              (4, [[0, 2], [1, 3]], "int8"), (4, [[0, 1, 2, 3]], "int4")])
def test_quantized_reduce_scatter_within_predicted_bound(world, groups, fmt):
    """qgZ, one hop: rank ``me``'s reduced chunk = its exact chunk + the peers' stochastically rounded chunks,
    summed in float32: within Σ over the other ranks of their block scale of the exact sum."""
    chunk = 1000                                    # not a multiple of BLOCK: the padded last block too
    results = run_ranks(_reduced, world, chunk, groups, fmt)
    for rank, (out, exact, stats) in enumerate(results):
        members = [g for g in groups if rank in g][0]
        me = members.index(rank)
        n = len(members)
        bound = sum(_block_scales(_grad_of(r, n * chunk).view(n, chunk), BLOCK, QMAX[fmt])[me]
                    for r in members if r != rank)
        err = (out - exact).abs()
        assert _bound_ok(err, bound, exact), (err / bound).max()
        assert err.max() > 0
        exact_bytes = n * chunk * 4 * (n - 1) // n
        assert exact_bytes / stats[qz.gradients_kind(qz.BITS[fmt])] >= RATIO[fmt]


@pytest.mark.parametrize("world,fmt", [(2, "int8"), (3, "int8"), (2, "int4"), (3, "int4")])
def test_quantized_all_reduce_within_predicted_bound(world, fmt):
    """qgZ, an all-reduce (no_shard; hybrid's replica hop): the reduce-scatter hop's bound on each piece,
    plus one step of the re-quantized float32 sum (bounded from the exact sum and hop 1's bound); every replica
    holds the same result."""
    total = 959                                     # 5 whole blocks per piece at world 3, one padded element
    results = run_ranks(_all_reduced, world, total, fmt)
    bits, qmax, kind = qz.BITS[fmt], QMAX[fmt], qz.gradients_kind(qz.BITS[fmt])
    if world == 2:
        return _check_pair_all_reduce(results, total, fmt)
    length = -(-total // world)
    grads = [torch.nn.functional.pad(_grad_of(r, total), (0, length * world - total)).view(world, length)
             for r in range(world)]
    exact_pieces = sum(grads)
    hop1 = torch.stack([sum(_block_scales(grads[r][o:o + 1], BLOCK, qmax)[0] for r in range(world) if r != o)
                        for o in range(world)])
    # the owner's float32 sum is within hop1 of the exact one: its block absmax, hence its scale, too
    nb = qz.blocks(length, BLOCK)
    upper = torch.nn.functional.pad(exact_pieces.abs() + hop1, (0, nb * BLOCK - length)).view(world, nb, BLOCK)
    hop2 = (upper.amax(-1, keepdim=True) / qmax).expand(world, nb, BLOCK).reshape(world, -1)[:, :length]
    bound = (hop1 + hop2).reshape(-1)[:total]
    out0, exact, stats = results[0]
    for out, _, _ in results[1:]:
        assert torch.equal(out, out0), "replicas reduced to different gradients"
    err = (out0 - exact).abs()
    assert _bound_ok(err, bound, exact), (err / bound).max()
    assert err.max() > 0
    assert stats[kind] == 2 * (world - 1) * qz.payload_elems(length, BLOCK, bits)   # two hops
    exact_bytes = 2 * total * 4 * (world - 1) // world
    assert exact_bytes / stats[kind] >= RATIO[fmt]


def _check_pair_all_reduce(results, total, fmt):
    """Two replicas: both quantized tensors all-gathered, summed dequantized: within s_0 + s_1 per element
    (each rank's block scale of its own gradient), one collective of payload(total) bytes per rank."""
    nb = qz.blocks(total, BLOCK)
    scale = [(torch.nn.functional.pad(_grad_of(r, total).abs(), (0, nb * BLOCK - total)).view(nb, BLOCK)
              .amax(-1, keepdim=True) / QMAX[fmt]).expand(nb, BLOCK).reshape(-1)[:total] for r in range(2)]
    (out0, exact, stats), (out1, _, _) = results
    assert torch.equal(out0, out1), "replicas reduced to different gradients"
    err = (out0 - exact).abs()
    assert _bound_ok(err, scale[0] + scale[1], exact), (err / (scale[0] + scale[1])).max()
    assert err.max() > 0
    kind, bits = qz.gradients_kind(qz.BITS[fmt]), qz.BITS[fmt]
    assert stats == {kind: qz.payload_elems(total, BLOCK, bits)}
    assert 2 * total * 4 // 2 / stats[kind] >= RATIO[fmt]


def _all_reduced(rank, world, total, fmt):
    grad = _grad_of(rank, total)
    q = fp.Quantization(gradients=fmt, block_size=BLOCK)
    fp.comm_stats.reset()
    out = grad.clone()
    comm.wait(qz.all_reduce(q, out, None), "test")
    exact = grad.clone()
    dist.all_reduce(exact)
    return out, exact, dict(fp.comm_stats.bytes)


def _train(rank, world, strategy, mesh, quant, dtype, steps):
    torch.manual_seed(0)
    model = GPT()
    mp = fp.MixedPrecision(param_dtype=dtype) if dtype is not None else None
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, device_mesh=mesh, mixed_precision=mp,
             quantization=quant)
    opt = make_optimizer("sgd", model.parameters())
    fp.comm_stats.reset()
    losses = train(model, opt, rank, world, steps)
    return losses, dict(fp.comm_stats.bytes)


@pytest.mark.parametrize("strategy,mesh,world,dtype,grads", [
    ("full_shard", None, 2, None, "int8"), ("shard_grad_op", None, 2, torch.bfloat16, "int8"),
    ("hybrid_shard", (2, 2), 4, None, "int8"), ("no_shard", None, 2, None, "int8"),
    ("full_shard", None, 2, None, "int4"), ("hybrid_shard", (2, 2), 4, None, "int4")])
def test_training_with_quantized_collectives(strategy, mesh, world, dtype, grads):
    """Training with both quantizations stays close to exact training (a regression guard: quantized training
    is a different computation, the bounds above are the exact claims), moves no exact unit bytes and fewer
    bytes in all."""
    quant = fp.Quantization(weights=None if strategy == "no_shard" else "int8", gradients=grads)
    got, q_bytes = run_ranks(_train, world, strategy, mesh, quant, dtype, 4)[0]
    want, e_bytes = run_ranks(_train, world, strategy, mesh, None, dtype, 4)[0]
    assert max(abs(a - b) / b for a, b in zip(got, want)) < 0.01, (got, want)
    assert got != want
    assert not {"all_gather", "reduce_scatter", "all_reduce"} & set(q_bytes), q_bytes
    exact = sum(e_bytes.get(k, 0) for k in ("all_gather", "reduce_scatter", "all_reduce"))
    quantized = q_bytes.get(qz.WEIGHTS_KIND, 0) + q_bytes[qz.gradients_kind(qz.BITS[grads])]
    assert exact / quantized >= (1.9 if dtype is torch.bfloat16 else 3.5), (e_bytes, q_bytes)


def _step_bytes(rank, world, strategy, mesh, quant):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, sharding_strategy=strategy, device_mesh=mesh,
                     quantization=quant)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model(*gpt_batch(0, rank)).backward()             # warm-up step records the order
    opt.step()
    fp.comm_stats.reset()
    model(*gpt_batch(1, rank)).backward()
    return ({k: v for k, v in fp.comm_stats.bytes.items() if k != "control"},
            {k: v for k, v in fp.comm_stats.calls.items() if k not in ("control", "barrier")})


@pytest.mark.parametrize("strategy,mesh,world,quant", [
    ("full_shard", None, 2, fp.Quantization(weights="int8", gradients="int8")),
    ("shard_grad_op", None, 3, fp.Quantization(weights="int8")),
    ("hybrid_shard", (2, 2), 4, fp.Quantization(weights="int8", gradients="int8", block_size=64)),
    ("no_shard", None, 2, fp.Quantization(gradients="int8")),
    ("hybrid_shard", (2, 2), 4, fp.Quantization(gradients="int4")),
    ("full_shard", None, 3, fp.Quantization(weights="int8", gradients="int4"))])
def test_plan_wire_bytes_equal_comm_stats(strategy, mesh, world, quant):
    """fp.plan prices the quantized kinds with the engine's payload: bytes and calls equal comm_stats."""
    got, calls = run_ranks(_step_bytes, world, strategy, mesh, quant)[0]
    plan = fp.plan(GPT, world_size=world, sharding_strategy=strategy, auto_wrap_policy={Block},
                   device_mesh=mesh, quantization=quant, inputs=lambda: gpt_batch(0, 0))
    assert plan.worlds[world].wire_bytes == got
    assert plan.worlds[world].wire_calls == calls
    assert quant.gradients is None or qz.gradients_kind(qz.bits_of(quant, "gradients")) in got


def _diverging(rank, world, mode, strategy, quant):
    from fsdp_plugin._groups.mesh import control_group
    from test_pairing import Net, Tower
    from test_pairing import Block as PBlock
    torch.manual_seed(0)
    model = fp.shard(Net(mode, 1), auto_wrap_policy={PBlock, Tower}, sharding_strategy=strategy, timeout_s=30,
                     quantization=quant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model.step = step
        opt.zero_grad()
        try:
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))).backward()
        except fp.CollectiveError as e:
            try:
                fp.reset(model)
            except fp.CollectiveError as after:
                # NCCL's semantics (nccl_sim): unequal collective counts abort the data groups (the divergence
                # says "restart the process group"); reset then reports the aborted in-flight collectives
                assert dist.get_backend() != "gloo" and "aborted" in str(after), after
            dist.barrier(group=control_group())     # the gloo control group outlives an abort
            return step, str(e), sorted(fp.comm_stats.bytes)
        opt.step()
    return 3, "no error", sorted(fp.comm_stats.bytes)


@pytest.mark.parametrize("mode,strategy", [("order", "full_shard"), ("swap", "full_shard"),
                                           ("tower", "no_shard"), ("order", "shard_grad_op")])
def test_the_pairing_check_covers_quantized_collectives(mode, strategy):
    """Quantized collectives are unit collectives: a unit run on some ranks only is a CollectiveError on
    every rank (tags on gloo point to point, announcements otherwise), never mismatched int8 rows."""
    quant = fp.Quantization(weights=None if strategy == "no_shard" else "int8", gradients="int8")
    for rank, (step, message, kinds) in enumerate(run_ranks(_diverging, 2, mode, strategy, quant, timeout=90)):
        assert step == 1, (rank, step, message)
        assert "ranks diverged" in message, message
        assert qz.GRADIENTS_KIND in kinds and "reduce_scatter" not in kinds and "all_reduce" not in kinds


def test_integrations_map_deepspeeds_keys():
    """accelerate / Trainer (``FSDP_PLUGIN_QUANTIZATION``, no key in accelerate's FSDP config) and Lightning
    (``FSDPPluginStrategy(zero_quantized_weights=True, ...)``, DeepSpeedStrategy's names) reach the config."""
    from fsdp_plugin.integrations.accelerate.config.from_env import settings_from_env
    from fsdp_plugin.integrations.accelerate.config.resolve import sharding_config
    from fsdp_plugin.integrations.lightning._fsdp_kwargs import translate

    env = {"ACCELERATE_USE_FSDP": "true", "FSDP_PLUGIN_QUANTIZATION": "zero_quantized_weights, gradients, block_size=128"}
    cfg = sharding_config(settings_from_env(env), GPT())
    assert cfg.quantization == fp.Quantization(weights="int8", gradients="int8", block_size=128)
    assert sharding_config(settings_from_env({"ACCELERATE_USE_FSDP": "true"}), GPT()).quantization is None
    env["FSDP_PLUGIN_QUANTIZATION"] = "gradients=int4, block_size=64"
    assert sharding_config(settings_from_env(env), GPT()).quantization == fp.Quantization(gradients="int4",
                                                                                           block_size=64)
    for bad, why in (("int4", "is not 'weights'"), ("block_size=64", "name 'weights' and/or"),
                     ("weights=int4", "gradients only")):
        with pytest.raises(fp.ConfigError, match=f"FSDP_PLUGIN_QUANTIZATION.*{why}"):
            settings_from_env({"ACCELERATE_USE_FSDP": "true", "FSDP_PLUGIN_QUANTIZATION": bad})
    out = translate({"zero_quantized_gradients": True, "sharding_strategy": "HYBRID_SHARD"})
    assert out["quantization"] == fp.Quantization(gradients="int8") and "zero_quantized_gradients" not in out
    assert translate({"zero_quantized_weights": False})["quantization"] is None
    with pytest.raises(fp.ConfigError, match="not both"):
        translate({"zero_quantized_weights": True, "quantization": fp.Quantization(weights="int8")})


@pytest.mark.slow
def test_the_demo_gpt_benchmark_runs_and_stays_within_one_percent(tmp_path):
    """benchmarks/quantized_gpt.py, short (the 300-step run is RESULTS § 35q): it exits non-zero past 1%."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "quantized_gpt.py"
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(path), "--steps", "15", "--configs",
                    "exact,int8 weights + gradients,int4 gradients", "--out", str(out)],
                   check=True, timeout=900, cwd=tmp_path)
    results = json.loads(out.read_text())["results"]
    assert results["int8 weights + gradients"]["bytes_per_step"]["reduce_q8"] > 0
    assert results["int4 gradients"]["bytes_per_step"]["reduce_q4"] > 0
