"""Which hardware the examples run on: the GPUs when there are any (NCCL, one process per GPU, bf16 where the GPU
supports it), the CPU otherwise (gloo processes, float32). Each example prints one line saying which, e.g.::

    fsdp_plugin example: 2 x CUDA (NVIDIA H200), bf16-mixed
    fsdp_plugin example: 2 CPU processes (gloo), 32-true: no GPU found
"""
from __future__ import annotations

import os

import torch

PREFIX = "fsdp_plugin example: "


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def bf16_ok() -> bool:
    """bf16 kernels on this GPU (Ampere and newer); False without a GPU."""
    return gpu_count() > 0 and torch.cuda.is_bf16_supported()


def line(processes: int, device: str, precision: str, why: str = "") -> str:
    """The one line every example prints at start (``device`` is "cuda" or "cpu")."""
    if device == "cuda":
        what = f"{processes} x CUDA ({torch.cuda.get_device_name(0)})"
    else:
        what = f"{processes} CPU process{'es' if processes != 1 else ''} (gloo)"
    return f"{PREFIX}{what}, {precision}" + (f": {why}" if why else "")


def lightning(devices: int, accelerator: str = "auto", precision: str | None = None) -> tuple[str, int, str, str]:
    """``(accelerator, devices, precision, line)`` for ``L.Trainer``.

    ``accelerator="auto"``: the GPUs when there are any, else ``devices`` CPU processes. Asking for more GPUs
    than the machine has clamps to what it has, and the line says so (``--accelerator cpu`` runs CPU processes
    instead). ``precision=None``: ``bf16-mixed`` on a GPU that supports bf16, else ``32-true``."""
    gpus = gpu_count()
    if accelerator == "cpu" or (accelerator == "auto" and gpus == 0):
        why = "no GPU found" if gpus == 0 else "--accelerator cpu"
        precision = precision or "32-true"
        return "cpu", devices, precision, line(devices, "cpu", precision, why)
    if gpus == 0:
        raise SystemExit(f"{PREFIX}--accelerator {accelerator}: no CUDA device on this machine")
    n = min(devices, gpus)
    precision = precision or ("bf16-mixed" if bf16_ok() else "32-true")
    why = "" if n == devices else (f"--devices {devices} asked, {gpus} GPU{'s' if gpus != 1 else ''} found: using "
                                   f"{n} (--accelerator cpu runs {devices} CPU processes instead)")
    return "gpu", n, precision, line(n, "cuda", precision, why)


def trainer_flags(bf16: bool | None) -> dict:
    """``TrainingArguments`` keywords: the GPU when there is one (``use_cpu`` otherwise), ``bf16`` by default
    where the GPU supports it (``bf16=None``: that default; True/False: as asked; bf16 also runs on CPU)."""
    use_cpu = gpu_count() == 0
    return dict(use_cpu=use_cpu, bf16=bf16_ok() if bf16 is None else bf16)


ACCELERATE_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed", "fp8": "fp8"}


def report(processes: int, device: torch.device | str, precision: str) -> str:
    """The line for a launched run (accelerate, Trainer): ``device`` is the process's device, ``precision``
    a Lightning flag or accelerate's ``mixed_precision`` ("no", "bf16", "fp16")."""
    precision = ACCELERATE_PRECISION.get(precision, precision)
    kind = torch.device(device).type
    why = "no GPU found" if kind == "cpu" and gpu_count() == 0 else ""
    if kind == "cpu" and gpu_count() > 0:      # a CPU config (use_cpu: true) on a GPU box: say so, name the fix
        why = (f"the config asks for the CPU (use_cpu) although {gpu_count()} GPU(s) are here: launch with "
               "--config_file examples/accelerate_fsdp_gpu.yaml to use them")
    if kind == "cuda" and processes < gpu_count():
        n = gpu_count()
        why = (f"{n} GPUs here, {processes} used: one process per GPU is accelerate launch --num_processes {n} "
               f"(torchrun --nproc_per_node {n})")
    return line(processes, kind, precision, why)


def is_launcher_process() -> bool:
    """True in the process a user started (Lightning's launcher re-runs the script with LOCAL_RANK set)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"
