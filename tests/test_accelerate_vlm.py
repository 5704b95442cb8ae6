"""A tiny LLaVA through the real ``accelerate launch`` (2 CPU processes, gloo) with the one-line install and
nothing declared: images on rank 0 only, on no rank, on both, on rank 1 only; per-step loss within 1e-5 of one
process on the global batch (the reference of test_some_ranks_vlm)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from _launch import run
from test_some_ranks_vlm import STEPS, WORLD, reference_losses

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: 'no'
use_cpu: true
rdzv_backend: static
same_network: true
fsdp_config:
  fsdp_version: 2
  fsdp_reshard_after_forward: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,CLIPEncoderLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_offload_params: false
  fsdp_cpu_ram_efficient_loading: false
  fsdp_sync_module_states: false
  fsdp_activation_checkpointing: false
"""


def test_accelerate_launch_llava_images_on_some_ranks(tmp_path):
    config = tmp_path / "fsdp.yaml"
    config.write_text(CONFIG)
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
           "--num_processes", str(WORLD), "--main_process_port", "0",
           str(ROOT / "tests" / "scripts" / "accelerate_vlm.py"), str(tmp_path)]
    out = run(cmd, timeout=240, cwd=ROOT, env={"FSDP_PLUGIN_TIMEOUT_S": "60"})
    assert "ACCELERATE_VLM_DONE" in out, out[-4000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["units"] == ["model.vision_tower"] and r["on_demand"] for r in reports), reports
    got = [sum(r["losses"][s] for r in reports) / WORLD for s in range(STEPS)]
    want = reference_losses()
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
