"""Two torchrun "nodes" on localhost (static rendezvous): hybrid sharding stays inside a node."""
import pytest

from _launch import free_port, run_all, torchrun


@pytest.mark.integration
def test_hybrid_across_two_torchrun_nodes():
    port = free_port()
    cmds = [torchrun("--nnodes", 2, "--nproc_per_node", 2, "--node_rank", n, "--master_addr", "127.0.0.1",
                     "--master_port", port, "tests/scripts/multinode_hybrid.py") for n in (0, 1)]
    (rc0, out0), (rc1, out1) = run_all(cmds, timeout=240)
    assert rc0 == 0 and rc1 == 0, out0[-3000:] + out1[-3000:]
    assert "MULTINODE_OK world=4 shard_size=2 replicate=2" in out0, out0[-3000:]
