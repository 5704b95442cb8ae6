"""accelerate ``ParallelismConfig(dp_shard_size=2, tp_size=2)`` through the real ``accelerate launch`` (world 4 on
CPU/gloo, issue 31): the accelerate loop and the transformers Trainer (after the one-line import) train a tiny
Llama with its own tp_plan like one plain process on the global batch, per step within 1e-5 (loss, clipped norm);
save_state / load_state round-trip the 2-D model bit-exactly."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _launch import run_all

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "accelerate_tp_check.py"
YAML = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 4
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
rdzv_backend: static
same_network: true
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
  fsdp_sync_module_states: false
  fsdp_activation_checkpointing: false
"""


def _close(got: list, want: list, tol: float = 1e-5) -> None:
    assert len(got) == len(want) and want, (got, want)
    assert max(abs(a - b) for a, b in zip(got, want)) <= tol, (got, want)


def test_parallelism_config_tp_matches_one_process(tmp_path):
    cfg = tmp_path / "tp.yaml"
    cfg.write_text(YAML)
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", cfg,
              "--main_process_port", "0", SCRIPT, tmp_path, "train"]
    (rc, out), (ref_rc, ref_out) = run_all([list(map(str, launch)),
                                            [sys.executable, str(SCRIPT), str(tmp_path), "reference"]], timeout=420)
    assert rc == 0 and "ACCELERATE_CHECK_DONE" in out, out[-6000:]
    assert ref_rc == 0, ref_out[-3000:]
    ranks = [json.loads((tmp_path / f"train_rank{r}.json").read_text()) for r in range(4)]
    ref = json.loads((tmp_path / "reference_rank0.json").read_text())
    r0 = ranks[0]
    assert r0["mesh"] == ["dp_shard", "tp"] and r0["dp_mesh"] == ["dp_shard"] and r0["settings"]["tensor_parallel"]

    # the accelerate loop: TP peers (ranks 2d, 2d+1) see one batch, the two dp ranks different ones
    loops = [r["loop"] for r in ranks]
    assert loops[0]["batch"] == loops[1]["batch"] and loops[2]["batch"] == loops[3]["batch"]
    assert loops[0]["batch"] != loops[2]["batch"]
    assert [a + b for a, b in zip(loops[0]["batch"], loops[2]["batch"])] == ref["loop"]["batch"]
    _close([(a + b) / 2 for a, b in zip(loops[0]["loss"], loops[2]["loss"])], ref["loop"]["loss"])
    assert min(ref["loop"]["norm"]) > 0.5                     # clipping bites, so the norm must be exact
    for lp in loops:
        _close(lp["norm"], ref["loop"]["norm"], 1e-5 * max(ref["loop"]["norm"]))
        assert lp["sharded"] and lp["opt_is_model"] and lp["dtensor_in_forward"] > 0 and lp["state_roundtrip"]
    assert sorted(loops[0]["params"]) == sorted(ref["loop"]["params"])
    for k, v in ref["loop"]["params"].items():
        _close(loops[0]["params"][k], v)

    # the Trainer: its own ParallelismConfig arithmetic (tp_size 2: batch 4 = 2 dp x 2 rows), our engine
    for r in ranks:
        t = r["trainer"]
        assert t["engine"] and t["tp_size"] == 2 and t["batch_total"] == 4 and t["checkpoint"]   # save_steps
        _close(t["loss"], ref["trainer"]["loss"])
        _close(t["grad_norm"], ref["trainer"]["grad_norm"], 1e-5 * max(ref["trainer"]["grad_norm"]))
    assert not ref["trainer"]["engine"] and ref["trainer"]["batch_total"] == 4
