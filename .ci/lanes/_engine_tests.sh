# The tests every torch lane runs: engine, checkpoint, planner and integration smoke (sourced by the lanes).
ENGINE_TESTS=(
  tests/test_compat.py                     # the range check, the collective forms this torch has
  tests/test_parity.py                     # every strategy, world 1-4, SGD and AdamW, against one process and DDP
  tests/test_native_collectives.py         # gloo through the branch NCCL takes
  tests/test_fake_world.py                 # torch's fake process group at world 8 and 1,024, bytes against fp.plan
  tests/test_mixed_precision.py
  tests/test_activation_checkpointing.py
  tests/test_checkpoint_dist.py            # save/load across world sizes
  tests/test_checkpoint_reshard.py
  tests/test_dcp_import.py                 # torch DCP directories (torch's own metadata classes)
  tests/test_plan.py                       # the planner (FLOP counter, fake tensors)
  tests/test_plan_flops_compat.py          # attention FLOPs of GQA/MoE/MLA/VLM models on every torch
  tests/test_accelerate_inprocess.py       # integration smoke: Accelerator in one process
  tests/test_lightning_register.py         # integration smoke: strategy="fsdp_plugin" resolves
)
