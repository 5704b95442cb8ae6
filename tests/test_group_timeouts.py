"""Issue 53, finding 7: torch's process-group timeout outlasts the engine's deadline on every group the engine uses
— its own groups are created from ``ShardingConfig.timeout_s``, and a borrowed group (the world group, a
DeviceMesh's) whose timeout is not longer makes ``fp.shard`` warn, naming the fix. Read through ``_compat``."""
import warnings
from datetime import timedelta

from _dist import run_ranks


def _worker(rank, world, timeout_s, strategy, mesh=None):
    import torch

    import fsdp_plugin as fp
    from fsdp_plugin import _compat
    from fsdp_plugin._groups.mesh import control_group
    from models import GPT, Block

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fp.shard(GPT(), auto_wrap_policy={Block}, sharding_strategy=strategy, timeout_s=timeout_s,
                         **({"device_mesh": mesh} if mesh else {}))
    m = model._fp_root.mesh
    seconds = {name: _compat.group_timeout(g, torch.device("cpu")).total_seconds()
               for name, g in (("world", None), ("shard", m.shard_group), ("control", control_group()))}
    return [str(w.message) for w in caught if "process-group timeout" in str(w.message)], seconds


def test_a_world_group_timeout_not_longer_than_the_deadline_warns_with_the_fix():
    """gloo's default group timeout is 30 min: a 3,000 s deadline outlasts it (the warning names both fixes);
    a 60 s deadline does not warn."""
    default = timedelta(minutes=30).total_seconds()
    for said, seconds in run_ranks(_worker, 2, 3000.0, "full_shard", timeout=120):
        assert seconds["world"] == default
        assert len(said) == 1, said
        assert "default (world) group" in said[0] and f"({default:.0f} s)" in said[0] and "(3000 s)" in said[0]
        assert "init_process_group(..., timeout=timedelta(seconds=3120))" in said[0]
        assert "FSDP_PLUGIN_TIMEOUT_S" in said[0] and "ShardingConfig(timeout_s=...)" in said[0]
        assert seconds["control"] == 3120.0      # the engine's own group: deadline + margin, from the config
    for said, _ in run_ranks(_worker, 2, 60.0, "full_shard", timeout=120):
        assert said == []


def test_the_engines_own_groups_outlast_the_configured_deadline():
    """hybrid's shard group and the control group are created with ``ShardingConfig.timeout_s`` + 120 s, not
    the environment's default deadline."""
    for said, seconds in run_ranks(_worker, 2, 2000.0, "hybrid_shard", (1, 2), timeout=120):
        assert said == []
        assert seconds["shard"] == seconds["control"] == 2120.0, seconds


def test_group_timeout_reads_what_the_group_was_created_with():
    def worker(rank, world):
        import torch
        import torch.distributed as dist
        from fsdp_plugin import _compat
        g = dist.new_group([0, 1], timeout=timedelta(seconds=77))
        dist.barrier(group=g)    # both ends connected before either rank returns and exits
        return _compat.group_timeout(g, torch.device("cpu")), _compat.group_timeout(g, torch.device("meta"))
    for got, absent in run_ranks(worker, 2, timeout=60):
        assert got == timedelta(seconds=77) and absent is None


def test_the_default_deadline_needs_no_warning_on_nccls_default_group_timeout():
    """NCCL's default process-group timeout is 10 min (torch's ``default_pg_nccl_timeout`` where NCCL is built): the
    default deadline (480 s) plus the backstop margin is exactly that, so a default GPU run neither warns nor races
    torch's watchdog; a deadline of 600 s on the same group does warn."""
    def worker(rank, world):
        from types import SimpleNamespace

        import torch
        import torch.distributed as dist
        from fsdp_plugin._groups import timeouts
        g = dist.new_group([0, 1], timeout=timedelta(minutes=10))
        dist.barrier(group=g)    # both ends connected before either rank returns and exits
        mesh = SimpleNamespace(shard_size=2, shard_group=g, replicate_size=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return (timeouts.backstop_timeout(None).total_seconds(),
                    timeouts.check(mesh, None, torch.device("cpu")), len(timeouts.check(mesh, 600.0, torch.device("cpu"))))
    for backstop, default_said, said_at_600 in run_ranks(worker, 2, timeout=60):
        assert backstop == timedelta(minutes=10).total_seconds()
        assert default_said == [] and said_at_600 == 1
