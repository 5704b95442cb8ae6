"""A tiny LLaVA under ``accelerate launch`` with the one-line install, images on some ranks only and nothing
declared; driven by tests/test_accelerate_vlm.py.

    accelerate launch --config_file CFG tests/scripts/accelerate_vlm.py OUT_DIR

Rank r trains on its own batches of ``test_some_ranks_vlm`` (SGD with momentum); each writes
``OUT_DIR/rank{r}.json``: its local loss per step, the some-ranks units and whether they are gathered on demand.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import test_some_ranks_vlm as v  # noqa: E402
from _parity import make_optimizer  # noqa: E402
from fsdp_plugin.integrations.accelerate import Accelerator  # noqa: E402  the one-line install


def main() -> None:
    accelerator = Accelerator()
    model = v.tiny_llava()
    opt = make_optimizer("sgd", model.parameters())
    model, opt = accelerator.prepare(model, opt)
    rank, losses = accelerator.process_index, []
    for s in range(v.STEPS):
        loss = model(**v.rank_batch(s, rank)).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    root = model._fp_root
    report = {"losses": losses, "units": [u.fqn for u in root.some_ranks_units], "on_demand": root.on_demand}
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(report))
    accelerator.print("ACCELERATE_VLM_DONE")


if __name__ == "__main__":
    main()
