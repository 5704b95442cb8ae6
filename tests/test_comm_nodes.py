"""``fp.comm_stats`` split into intra- and inter-node bytes (nodes of ``LOCAL_WORLD_SIZE`` consecutive ranks)."""
import torch

import fsdp_plugin as fp
from tests._dist import run_ranks
from tests.models import GPT, Block, gpt_batch

TWO_NODES = {"LOCAL_WORLD_SIZE": "2"}


def _one_step(rank, world, strategy, mesh, quantization=None):
    torch.manual_seed(0)
    kwargs = {"quantization": quantization} if quantization else {}
    if mesh:
        kwargs["device_mesh"] = mesh
    model = fp.shard(GPT(), auto_wrap_policy={Block}, sharding_strategy=strategy, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fp.comm_stats.reset()
    model(*gpt_batch(0, rank)).backward()
    opt.step()
    chunks = [h.chunk * h.reduce_dtype.itemsize for u in model._fp_root.units for h in u.handles]
    return fp.comm_stats.snapshot(), chunks


def test_full_shard_on_two_nodes_sends_two_of_three_peers_bytes_across():
    for stats, _ in run_ranks(_one_step, 4, "full_shard", None, env=TWO_NODES):
        for kind in ("all_gather", "reduce_scatter"):
            total, inter, intra = (stats[k][kind] for k in ("bytes", "inter_node_bytes", "intra_node_bytes"))
            assert total > 0 and inter + intra == total
            assert 3 * inter == 2 * total, (kind, total, inter)    # 2 of a rank's 3 peers are on the other node


def test_hybrid_keeps_its_shard_collectives_inside_the_node_and_all_reduces_across():
    for stats, chunks in run_ranks(_one_step, 4, "hybrid_shard", (2, 2), env=TWO_NODES):
        for kind in ("all_gather", "reduce_scatter"):
            assert stats["inter_node_bytes"].get(kind, 0) == 0 and stats["intra_node_bytes"][kind] == stats["bytes"][kind]
        # one all-reduce of each handle's reduced chunk over a replicate group of 2: 2·chunk·(2−1)/2 bytes
        assert stats["inter_node_bytes"]["all_reduce"] == sum(chunks)
        assert stats["intra_node_bytes"].get("all_reduce", 0) == 0


def test_quantized_hybrid_keeps_the_node_exact_and_sends_only_int8_across():
    """Across nodes, quantization applies where bytes cross the link: hybrid's in-node shard collectives stay
    exact (no compute or precision spent on loopback/NVLink bytes) and only the replica hop's int8 blocks cross,
    split by the exchange's own group (a bug counted every all-to-all byte as crossing)."""
    q = fp.Quantization(weights="int8", gradients="int8")
    for stats, chunks in run_ranks(_one_step, 4, "hybrid_shard", (2, 2), q, env=TWO_NODES):
        inter, intra = stats["inter_node_bytes"], stats["intra_node_bytes"]
        assert intra["all_gather"] == stats["bytes"]["all_gather"] > 0 and "all_gather_q8" not in stats["bytes"]
        assert intra["reduce_scatter"] == stats["bytes"]["reduce_scatter"] > 0
        assert intra.get("reduce_q8", 0) == 0 and inter.get("reduce_scatter", 0) == 0
        # across: the replica hop's exchange + all-gather of int8 + scales, ~4x less than the exact all-reduce
        assert 3.5 * inter["reduce_q8"] <= sum(chunks) <= 4.0 * inter["reduce_q8"], (inter, sum(chunks))


def test_quantization_on_one_node_applies_to_every_collective():
    q = fp.Quantization(weights="int8", gradients="int8")
    stats, _ = run_ranks(_one_step, 4, "hybrid_shard", (2, 2), q, env={"LOCAL_WORLD_SIZE": "4"})[0]
    assert stats["bytes"]["all_gather_q8"] > 0 and "all_gather" not in stats["bytes"]
    assert stats["bytes"]["reduce_q8"] > 0 and "reduce_scatter" not in stats["bytes"]


def test_one_node_by_default_everything_stays_inside():
    stats, _ = run_ranks(_one_step, 2, "full_shard", None)[0]
    assert stats["inter_node_bytes"].get("all_gather", 0) == 0
    assert stats["intra_node_bytes"]["all_gather"] == stats["bytes"]["all_gather"] > 0


def _hybrid_events(rank, world):
    """The order of reduce-scatter waits, cross-replica all-reduce issues and their waits in one backward."""
    from fsdp_plugin._comm import collectives as comm
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, sharding_strategy="hybrid_shard", device_mesh=(2, 2))
    events, real_wait, real_ar = [], comm.wait, comm.all_reduce
    root = model._fp_root

    def wait(work, what="collective", timeout_s=None):
        if "cross-replica" in what or "gradient reduction" in what:
            events.append(("wait " + what.split(" of ")[0], root.reduction.state.name, len(root.reduction._pending)))
        return real_wait(work, what, timeout_s)

    def all_reduce(t, group, *args, **kwargs):
        if group is root.mesh.replicate_group:
            events.append(("issue all-reduce",))
        return real_ar(t, group, *args, **kwargs)
    comm.wait, comm.all_reduce = wait, all_reduce
    try:
        model(*gpt_batch(0, rank)).backward()
    finally:
        comm.wait, comm.all_reduce = real_wait, real_ar
    return events, sum(len(u.handles) for u in root.units)


def test_hybrid_cross_node_all_reduces_overlap_backward_and_are_waited_at_its_end():
    for events, handles in run_ranks(_hybrid_events, 4, env=TWO_NODES):
        kinds = [e[0] for e in events]
        assert kinds.count("issue all-reduce") == handles == kinds.count("wait cross-replica all-reduce")
        first_ar_wait = kinds.index("wait cross-replica all-reduce")
        # every all-reduce is issued (and every reduce-scatter waited) before the first all-reduce wait ...
        assert kinds[:first_ar_wait].count("issue all-reduce") == handles
        assert kinds[:first_ar_wait].count("wait gradient reduction") == handles
        # ... and the all-reduce waits happen in the end-of-backward callback (the reduction is AGREEING then)
        assert {e[1] for e in events if e[0] == "wait cross-replica all-reduce"} == {"AGREEING"}
