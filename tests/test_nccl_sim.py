"""Issue 53: the branch every NCCL user takes, run on CPU through ``nccl_sim`` (``fsdp_plugin.testing``): a backend
whose collectives complete asynchronously, whose works answer ``is_completed()`` truthfully and whose
host-blocking calls are counted. The engine takes its stream-transport branch there (plain waits, the deadline
monitor, the ledger-hash pairing check), so these counted facts are the ones a GPU job has.

.ci/run's nccl_sim lane also runs the parity, quantized, checkpoint, mixed-precision and activation-checkpointing
suites with ``FSDP_TEST_BACKEND=nccl_sim`` (``tests/_dist.py``).
"""
import time

import pytest

from _dist import run_ranks

import fsdp_plugin as fp

SIM = {"FSDP_TEST_BACKEND": "nccl_sim"}


def _semantics(rank, world):
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import fsdp_plugin.testing as T
    facts = {"backend": dist.get_backend()}
    T.COUNTERS.reset()
    out = torch.empty(2 * world)
    work = dist.all_gather_into_tensor(out, torch.full((2,), float(rank)), async_op=True)
    seen = []
    poller = threading.Thread(target=lambda: seen.append(work.is_completed()))   # another thread: not counted
    poller.start()
    poller.join()
    work.wait()
    facts["gathered"] = out.tolist()
    facts["completed"] = work.is_completed()          # the issuing thread polls: counted
    work.wait(timedelta(seconds=30))                  # a timed wait blocks the host on NCCL: counted
    facts["host"], facts["stream_waits"] = dict(T.COUNTERS.host), T.COUNTERS.stream_waits
    # a mismatched collective (different sizes) never completes; its wait returns, over NaN (the host runs ahead)
    bad = torch.zeros(world * (2 + rank))
    stuck = dist.all_gather_into_tensor(bad, torch.ones(2 + rank), async_op=True)
    stuck.wait()
    later = dist.all_reduce(torch.ones(1), async_op=True)       # queued behind it: stuck too
    later.wait()
    facts["stuck"] = (stuck.is_completed(), later.is_completed(), bool(bad.isnan().all()))
    dist.distributed_c10d._get_default_group().abort()
    facts["aborted"] = stuck.is_completed()
    try:
        stuck.wait()
        facts["raised"] = None
    except RuntimeError as e:
        facts["raised"] = str(e)
    return facts


def test_the_backend_has_nccls_completion_semantics():
    for facts in run_ranks(_semantics, 2, env=SIM, timeout=60):
        assert facts["backend"] == "nccl_sim"
        assert facts["gathered"] == [0.0, 0.0, 1.0, 1.0]
        assert facts["completed"] is True
        assert facts["host"] == {"is_completed": 1, "wait(timeout)": 1}, facts
        assert facts["stream_waits"] == 1
        assert facts["stuck"] == (False, False, True)
        assert facts["aborted"] is True and "aborted" in facts["raised"]


def _counted_steps(rank, world, strategy, n_layer, quant, mesh):
    """Train 4 steps; per steady step (the last two): host-blocking calls, control-group waits, watched works."""
    import torch

    import fsdp_plugin.testing as T
    from fsdp_plugin._comm import collectives as comm
    from fsdp_plugin._comm.stats import SYNC
    from _parity import make_optimizer
    from models import GPT, Block, gpt_batch

    torch.manual_seed(0)
    model = GPT(n_layer=n_layer)
    weights = None if strategy == "no_shard" else "int8"       # no_shard gathers no weights
    kw = {"quantization": fp.Quantization(weights=weights, gradients="int8")} if quant else {}
    if mesh:
        kw["device_mesh"] = mesh
    fp.shard(model, auto_wrap_policy={Block}, sharding_strategy=strategy, **kw)
    opt = make_optimizer("sgd", model.parameters())
    steps = []
    for s in range(4):
        T.COUNTERS.reset()
        waits, watched = dict(SYNC.waits), comm.MONITOR.watched
        loss = model(*gpt_batch(s, rank))
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps.append({"host": dict(T.COUNTERS.host), "watched": comm.MONITOR.watched - watched,
                      "waits": {k: v - waits.get(k, 0) for k, v in SYNC.waits.items() if v - waits.get(k, 0)}})
    return steps[2:], model._fp_root.pairing, loss.item()


CASES = [("full_shard", False, None), ("shard_grad_op", False, None), ("no_shard", False, None),
         ("hybrid_shard", False, (2, 2)), ("full_shard", True, None), ("no_shard", True, None)]


@pytest.mark.parametrize("strategy,quant,mesh", CASES)
def test_a_steady_step_blocks_the_host_nowhere_and_meets_once(strategy, quant, mesh):
    """Per steady step on NCCL's branch: no host-blocking call (no poll, no timed wait), quantized collectives
    included; the pairing check is the step's one control all-reduce (hash mode), whatever the number of units
    (before: a gloo announcement waited before every unit collective, 12 per step at 3 layers, 21 at 6; and
    every quantized run aborted at its first all-gather)."""
    world = 4 if mesh else 2
    per_layers = {}
    for n_layer in (2, 5):
        results = run_ranks(_counted_steps, world, strategy, n_layer, quant, mesh, env=SIM, timeout=120)
        for steps, pairing, loss in results:
            assert pairing == "hash"
            assert loss == loss                                  # not NaN: nothing ran over a stuck collective
            for step in steps:
                assert step["host"] == {}, (strategy, n_layer, step)
                assert step["watched"] > n_layer, (strategy, n_layer, step)   # the monitor holds every unit's
        per_layers[n_layer] = results[0][0][-1]["waits"]
    assert per_layers[2] == per_layers[5], per_layers            # constant in the number of units
    assert sum(per_layers[2].values()) <= 2, per_layers


def test_a_divergence_is_named_on_every_rank_and_fp_reset_recovers():
    """Rank 0 swaps two equal-sized blocks at step 1: NCCL would pair the collectives by order and exchange the
    wrong unit's data without an error. The step's ledger hash (one control all-reduce) names it on every rank
    at the end of that backward, before any gradient reaches the optimizer; fp.reset discards the step and
    training goes on in step (a divergence costs the step it happened in)."""
    from test_pairing_auto import _hashed
    for rank, (errors, losses) in enumerate(run_ranks(_hashed, 2, "swap", env=SIM, timeout=120)):
        assert [step for step, _, _ in errors] == [1], (rank, errors)
        message = errors[0][1]
        assert "ranks diverged" in message and "rank 0: " in message and "rank 1: " in message, message
        assert losses[0] == losses[1], losses


def _late_then_save(rank, world, tmp):
    import torch

    from _parity import make_optimizer
    from models import GPT, Block, gpt_batch

    torch.manual_seed(0)
    model = GPT()
    fp.shard(model, auto_wrap_policy={Block}, timeout_s=3)
    opt = make_optimizer("sgd", model.parameters())
    loss = model(*gpt_batch(0, rank))
    loss.backward()
    opt.step()
    fp.save_checkpoint(f"{tmp}/step1", model, opt)
    if rank == 1:                   # never joins the next step: rank 0's first all-gather can never complete
        time.sleep(8)
        return None
    import fsdp_plugin.testing as T
    out = {}
    try:
        model(*gpt_batch(1, rank)).sum().backward()
    except fp.CollectiveError as e:
        out["deadline"] = str(e)
    out["aborts"] = T.COUNTERS.aborts          # the monitor aborted the real group (deadlines.abort_group)
    for name, call in (("save", lambda: fp.save_checkpoint(f"{tmp}/step2", model, opt)), ("step", opt.step),
                       ("export", lambda: fp.full_state_dict(model))):
        try:
            call()
            out[name] = None
        except fp.CollectiveError as e:
            out[name] = str(e)
    return out


def test_after_a_deadline_nothing_is_saved_and_no_step_is_taken(tmp_path):
    """The rule (``_comm/failure.py``): on a stream transport the host ran ahead of the stuck collective, so the
    process's training state is poisoned; saves, steps and exports refuse, naming the last good checkpoint."""
    out = run_ranks(_late_then_save, 2, str(tmp_path), env=SIM, timeout=120, may_die=(1,))[0]
    assert "did not complete within 3s" in out["deadline"] and "rank 1" in out["deadline"], out["deadline"]
    for name in ("save", "step", "export"):
        assert out[name] is not None and "refused" in out[name], (name, out[name])
        assert f"{tmp_path}/step1" in out[name], out[name]
    assert not (tmp_path / "step2").exists()
    assert out["aborts"] == 1


def _hang_everywhere(rank, world):
    """A network fault: every rank's collectives stop completing while the hosts run ahead (NCCL's waits do not
    block). The report must say the collective is stuck everywhere, not that the ranks diverged."""
    import torch
    import torch.distributed as dist

    from _parity import make_optimizer
    from models import GPT, Block, gpt_batch

    torch.manual_seed(0)
    model = GPT()
    fp.shard(model, auto_wrap_policy={Block}, timeout_s=2)
    opt = make_optimizer("sgd", model.parameters())
    dist.distributed_c10d._get_default_group().hang()
    for s in range(200):
        try:
            loss = model(*gpt_batch(s, rank))
            loss.backward()
            opt.step()
            time.sleep(0.05)
        except fp.CollectiveError as e:
            return str(e)
    return None


def test_a_hang_on_every_rank_is_reported_as_a_hang_not_a_divergence():
    for message in run_ranks(_hang_everywhere, 2, env=SIM, timeout=120):
        assert message is not None and "did not complete within 2s" in message, message
        assert "ran different collectives" not in message, message
        assert "Waiting in #" in message or "Every rank is inside this collective" in message, message


@pytest.mark.integration
def test_nccl_sim_under_torchrun():
    """README's recipe under a real launcher at world 3: the backend registers from an import, torchrun's env://
    rendezvous works, and a step blocks the host nowhere."""
    import os

    from _launch import ROOT, free_port, run, torchrun
    script = os.path.join(ROOT, "tests", "scripts", "nccl_sim_torchrun.py")
    out = run(torchrun("--nproc-per-node", 3, "--master-port", free_port(), script),
              env={"PYTHONPATH": os.path.join(ROOT, "tests")}, timeout=180)
    import re
    # ranks print concurrently: two lines may share one (no newline between them), so match anywhere
    assert sorted(re.findall(r"NCCL_SIM_OK (\d+) ", out)) == ["0", "1", "2"], out[-3000:]
