"""torch's fake process group runs the engine at any world size in one CPU process, unpatched: fp.shard, AdamW
steps, fp.save_checkpoint and fp.plan at world 8 and 1,024 (tests/scripts/fake_world.py), and the per-rank
parameter and optimizer bytes equal fp.plan's, for full_shard, shard_grad_op, no_shard and hybrid. This is how
a user checks a 1,024-GPU job's memory per rank on a laptop (README, "Estimate a cluster's memory on one machine").
"""
import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "fake_world.py")


def _rows(world, *flags):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK")}
    p = subprocess.run([sys.executable, SCRIPT, str(world), *flags], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    return {r["strategy"]: r for r in map(json.loads, (ln for ln in p.stdout.splitlines() if ln.startswith("{")))}


@pytest.mark.parametrize("world,hybrid", [(8, (2, 4)), (1024, (128, 8))])
def test_fake_world_bytes_equal_the_plan(world, hybrid):
    rows = _rows(world)
    assert set(rows) == {"full_shard", "shard_grad_op", "no_shard", "hybrid_shard"}
    want_dims = {"full_shard": (world, 1), "shard_grad_op": (world, 1), "no_shard": (1, world),
                 "hybrid_shard": (hybrid[1], hybrid[0])}
    for strategy, r in rows.items():
        assert (r["shard"], r["replicate"]) == want_dims[strategy], r
        assert r["param_bytes"] == r["plan_param_bytes"], r
        assert r["moment_bytes"] == r["plan_optimizer_bytes"], r
        # the control group is the fake world group and pairing is off there (no peer can diverge)
        assert r["pairing"] == "off", r
        assert "published nothing" in r["save_warning"], r
    # sharding really divides: a full_shard rank holds ~1/world of no_shard's bytes (row padding grows with the
    # world: a 27,840-parameter model cut 1,024 ways is mostly padding, hence the cap at 64)
    full, none = rows["full_shard"]["param_bytes"], rows["no_shard"]["param_bytes"]
    assert full <= none * 1.1 / min(world, 64), (full, none)
    assert rows["hybrid_shard"]["param_bytes"] <= none * 1.1 / hybrid[1]


def test_no_host_wait_inside_a_step_on_a_native_backend():
    """Issue 48: on every backend but gloo (here torch's fake one, the branch NCCL takes) a training step passes
    no deadline to a backend wait (each would block the host until the GPU is done: 29 per step of a 5-unit
    Llama before), polls nothing on the host, and hands each wait to the deadline monitor instead; the one value
    the engine reads (the unused-parameter masks) is a host tensor when the model is on a GPU."""
    rows = _rows(8, "--host-waits")
    mask_read = {"fsdp_plugin/_reduce/usage.py"}
    for strategy, r in rows.items():
        for step in r["steps"]:
            assert step["timed"] == {} and step["host"] == {}, (strategy, step)
            assert step["watched"] == 0, (strategy, step)      # fake works have nothing left to do: none watched
            assert {site.split(":")[0] for site in step["reads"]} <= mask_read, (strategy, step["reads"])
        assert r["cuda_mask_device"] == "cpu", r
