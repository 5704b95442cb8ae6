# Lane: the newest lightning / accelerate / transformers / peft / trl the registry offers, on the pinned torch.
# Catches a library release that breaks an integration (accelerate 1.16.0's prepare() did) before users do.
# bash .ci/lane libs-newest   (a fresh .venv-lane-libs-newest; its versions are printed before the tests)
TORCH_PIN="torch==2.13.0"
PINS=(lightning accelerate transformers peft trl
      pytorch-lightning)   # test_lightning_register (torch-newest): `import pytorch_lightning as pl`
TESTS=(
  tests/test_accelerate_inprocess.py       # Accelerator in one process: prepare, clip, save/load_state
  tests/test_accelerate_config.py          # accelerate config / plugin translation, the shipped yamls
  tests/test_accelerate_launch.py          # accelerate launch: parity, resume on another process count
  tests/test_hf_trainer.py                 # transformers Trainer + TRL SFTTrainer + PEFT LoRA, launched
  tests/test_hf_trainer_config.py          # TrainingArguments(fsdp=...) translation
  tests/test_trl_vllm_sync.py              # TRL GRPO / online DPO weight sync to a stand-in vLLM
  tests/test_lightning_integration.py      # Lightning Trainer + Fabric: parity, checkpoints, resume, bf16
  tests/test_lightning_precision.py        # Lightning precision flags on the strategy
)
# ~6 minutes on 2 cores: the slowest named in the log; torch.compile with Lightning's AsyncCheckpointIO (67 s) is
# the pinned torch's business, checked by the main suite
PYTEST_ARGS=(-n 2 --dist loadfile --durations=12
             --deselect tests/test_lightning_integration.py::test_async_checkpoints_and_compiled_model)
