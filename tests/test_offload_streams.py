"""cpu_offload's copy streams under the caching allocator's pool model (issue 53 follow-up).

``_flat/offload.py`` calls no ``record_stream``: a host-to-device copy's destination is allocated on the stream that
uses it and ``h2d`` waits for that stream before writing it; a gradient chunk the ``d2h`` copy reads is held
(``HostCopier._reading``) until the compute stream waited for that copy or the host synchronized. test_offload.py
unit-tests those rules; here a short real training run with ``cpu_offload=True`` (the offload tests' ``FakeBackend``,
its streams and events those of ``tests/_pools.py``'s `PoolModel`) is checked by the model at world 1 and world 2
(gloo), fp32 and bf16 compute:

* every copy issued inside ``backend.use(h2d / d2h)`` is an op on that stream (an access of the blocks it touches);
* ``wait_event`` / ``wait_stream`` order streams, ``synchronize`` tells the host (a free after it is safe);
* the comm side streams are the fake CUDA module's, as in test_streams.py (at world 2 the all-gather's source is
  copied while the gather stream is current).

The model must find nothing, and must have checked blocks that ``h2d`` and ``d2h`` touched; with one protective wait
removed (the copier releasing a chunk with no stream wait, ``h2d`` not waiting for the destination's stream, a host
synchronize that proves nothing) it must find the hazard."""
import pytest

from _dist import run_ranks
from _pools import PoolModel, pool_worker


GLOO = {"FSDP_TEST_BACKEND": "gloo"}    # the model sees collectives as dispatcher ops (c10d::...): gloo issues them so


def _run(world, mixed, broken=""):
    """Every rank's (losses, violations, what the model checked) after two offloaded training steps."""
    return run_ranks(pool_worker, world, "full_shard", mixed, 2, None, True, broken, env=GLOO, timeout=120)


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [1, 2])
def test_offload_copies_never_hand_a_block_to_a_stream_unordered(world, mixed):
    for losses, violations, seen in _run(world, mixed):
        assert violations == [], violations[:3]
        # it saw the traffic: freed blocks another stream had touched, among them h2d's and d2h's
        assert seen["checked"] > 50 and seen["cross_by"].get("h2d", 0) > 0 and seen["cross_by"].get("d2h", 0) > 0, seen
        assert seen["first_uses"].get("h2d", 0) > 0, seen       # h2d wrote blocks of its user's pool
        assert seen["host"].get("d2h", 0) > 0, seen             # the end-of-backward wait told the host
        assert len(losses) == 2


@pytest.mark.parametrize("broken,stream", [("release", "d2h"), ("h2d_wait", "h2d"), ("host_sync", "d2h")])
@pytest.mark.parametrize("world", [1, 2])
def test_the_offload_pool_check_can_fail(world, broken, stream):
    """One protective wait removed: a released gradient chunk whose copy nothing waited for ("release"), an h2d
    copy into a block of its user's pool without waiting for that stream ("h2d_wait"), a host synchronize that
    proves nothing ("host_sync": the chunks ``finish_backward`` frees). The model reports it on every rank."""
    for _, violations, _ in _run(world, True, broken):
        assert any(repr(stream) in v for v in violations), (broken, violations[:3])


def test_the_pool_model_knows_what_the_host_saw():
    """Rule 1 with the host: a block read on d2h, freed, reused by its pool's stream, is safe once the host
    synchronized an event after the read — not otherwise. Rule 2: a block allocated on compute is written on h2d
    only after h2d waited for compute."""
    import torch
    ops = torch.ops.aten
    for synced in (False, True):
        m = PoolModel()
        chunk = m.run("compute", ops.ones.default, ([8],), {})
        m.wait("d2h", "compute")
        m.run("d2h", ops.clone.default, (chunk,), {})
        if synced:
            m.host_sync(m.record("d2h"))
        del chunk
        m.run("compute", ops.zeros.default, ([8],), {})
        assert bool(m.violations) is not synced, m.violations
    for waited in (False, True):
        m = PoolModel()
        out = m.run("compute", ops.empty.memory_format, ([8],), {})
        if waited:
            m.wait_event("h2d", m.record("compute"))
        m.run("h2d", ops.fill_.Scalar, (out, 1.0), {})
        assert bool(m.violations) is not waited, m.violations


def test_offload_copies_under_no_shard_and_hybrid():
    """The other reduction paths (no_shard's all-reduce, hybrid's replica all-reduce of the chunk d2h reads),
    bf16 compute: no violation either, with h2d and d2h traffic checked."""
    for strategy, world, mesh in (("no_shard", 2, None), ("hybrid_shard", 4, (2, 2))):
        for _, violations, seen in run_ranks(pool_worker, world, strategy, True, 2, mesh, True, "", env=GLOO,
                                             timeout=120):
            assert violations == [], (strategy, violations[:3])
            assert seen["cross_by"].get("h2d", 0) > 0 and seen["cross_by"].get("d2h", 0) > 0, (strategy, seen)
