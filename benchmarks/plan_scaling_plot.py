"""Draw benchmarks/plan_scaling.json (from plan_scaling.py) as two PNGs next to the FSDP paper's trends.

    python3 benchmarks/plan_scaling_plot.py benchmarks/plan_scaling.json

Needs only matplotlib (no torch). Paper numbers (Zhao et al. 2023, PyTorch FSDP, A100 80GB, 2 Tb/s RoCE),
as summarised in shared/research/anchors.md from a secondary summary of the paper: GPT-175B ~173 TFLOPS/GPU
at B=1 and ~186 at B=2, near-linear from 128 to 512 GPUs; T5-11B per-GPU TFLOPS ~148 at 8 GPUs falling ~7% by
512; T5-611M 15.18 TFLOPS/GPU; peak memory per GPU falls as GPUs are added.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAPER_TFLOPS = {   # model label -> [(gpus, TFLOPS per GPU)], approximate, see the docstring
    "175B (GPT-175B)": [(128, 173), (512, 173)],
    "11B (T5-11B size)": [(8, 148.5), (512, 148.5 * 0.93)],
}


def main(path):
    data = json.loads(Path(path).read_text())
    out = Path(path).parent
    hw = data["hardware"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in data["models"]:
        ws = [r["world"] for r in m["rows"]]
        ax.plot(ws, [r["peak_bytes"] / 2**30 for r in m["rows"]], marker="o", label=m["model"])
    ax.axhline(data["hardware_inputs"]["memory"] / 2**30, color="k", ls="--", lw=1, label=f"{hw} memory")
    ax.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="predicted peak memory per GPU (GiB)",
           title=f"fp.plan: memory per GPU vs GPUs (full_shard, bf16, AdamW, AC, B=1 x {data['seq']})")
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "plan_scaling_memory.png", dpi=110)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, m in enumerate(data["models"]):
        ws = [r["world"] for r in m["rows"]]
        line, = ax.plot(ws, [r["tflops_per_gpu"] for r in m["rows"]], marker="o", label=f"{m['model']} (fp.plan)")
        if m["model"] in PAPER_TFLOPS:
            px, py = zip(*PAPER_TFLOPS[m["model"]])
            ax.plot(px, py, ls=":", marker="s", color=line.get_color(), label=f"{m['model']} (paper, approx.)")
    ax.set(xscale="log", xlabel="GPUs", ylabel="TFLOP/s per GPU (counted FLOPs incl. recompute)",
           title=f"fp.plan: per-GPU throughput vs GPUs on {hw}")
    ax.set_xticks(ws, [str(w) for w in ws])
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "plan_scaling_tflops.png", dpi=110)
    print(f"wrote {out / 'plan_scaling_memory.png'} and {out / 'plan_scaling_tflops.png'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "plan_scaling.json"))
