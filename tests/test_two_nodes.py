"""The two-node testbed (benchmarks/two_nodes): two network namespaces, a tc-capped link, torchrun --nnodes 2.
The bytes that cross the link (veth counter) equal fp.comm_stats' inter-node bytes (TCP headers, ACKs and two barriers: within 5% + 64 KB on this tiny model; 0.3% on small)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_two_node_testbed_link_bytes_equal_comm_stats_inter_node_bytes(tmp_path):
    out = tmp_path / "r.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks/two_nodes/run.py"), "--preset", "tiny", "--rates", "200mbit",
           "--per-node", "2", "--configs", "full_shard,hybrid_shard,hpz,hybrid_q8g", "--steps", "1", "--rounds", "1",
           "--timeout", "400", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                                                                              "TWO_NODES_NET": "10.233.0"})
    if r.returncode == 77:    # not root / no namespaces here: the testbed says why (CI runs as root)
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["config"]: row for row in map(json.loads, out.read_text().splitlines())}
    for name, row in rows.items():
        x = row["rounds"][0]
        link = sum(x["link_tx_per_node"]) / len(x["link_tx_per_node"])
        assert x["inter_bytes_per_node"] > 0
        assert abs(link - x["inter_bytes_per_node"]) <= 0.05 * x["inter_bytes_per_node"] + 64e3, (name, x)
    # hpZ's backward all-gathers stay in the node; hybrid sends the least
    assert rows["hybrid_shard"]["rounds"][0]["inter_bytes_per_node"] < rows["hpz"]["rounds"][0]["inter_bytes_per_node"] \
        < rows["full_shard"]["rounds"][0]["inter_bytes_per_node"]
    # int8 gradients cross as a quarter of hybrid's fp32 bytes plus the block scales; the stored spec reads back
    q8, exact = (rows[n]["rounds"][0]["inter_bytes_per_node"] for n in ("hybrid_q8g", "hybrid_shard"))
    assert 0.25 * exact < q8 < 0.3 * exact, (q8, exact)
    assert rows["hybrid_q8g"]["spec"]["quantization"]["gradients"] == "int8"
