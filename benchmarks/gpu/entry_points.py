"""Issue 50: every user entry point on a GPU, through the launchers users run (a few steps each).

    python benchmarks/gpu/entry_points.py          # on a CUDA machine (one GPU is enough: world 1)
    python benchmarks/gpu/entry_points.py --dry    # the same checks on CPU (gloo), to rehearse them

Checks (one ``GPU_CHECK_JSON {...}`` line each; exit 0 when every one passes):

1. ``lightning_32``: ``Trainer(accelerator="gpu", devices=1, strategy="fsdp_plugin")``, ``32-true``, saved after
   step 4 and resumed to step 8, equal to Lightning's ``ddp`` within 1e-5 (straight and resumed; relative to the
   loss scale, as the tests measure it);
2. ``lightning_bf16`` / ``lightning_16``: ``bf16-mixed`` and ``16-mixed`` (``fp.GradScaler``): finite, the resumed
   steps equal the straight run's, and within 2e-2 of Lightning's own ``fsdp`` strategy (``16-mixed`` is
   CUDA-only in Lightning: skipped by ``--dry``);
3. ``accelerate``: ``accelerate launch --config_file examples/accelerate_fsdp_gpu.yaml examples/accelerate_train.py``
   (bf16), ``save_state`` then ``--resume``;
4. ``trainer``: ``examples/hf_trainer.py`` (TRL ``SFTTrainer``, the one-line import) with ``--bf16``, same config;
5. ``peft_lora``: ``examples/peft_lora.py`` (only the adapter trains; merged = adapter model);
6. ``trl_grpo_sync``: TRL GRPO's ``VLLMGeneration.sync_weights`` to a stand-in vLLM (server: a receiver process
   on its own gloo group; colocate: ``load_weights``), bit-equal to ``fp.full_state_dict`` (tests/test_trl_vllm_sync.py).

Lightning runs use tests/scripts/lightning_train.py, the launches run the examples as README shows them, and
the TRL check reuses the test's stand-ins: nothing is copied. Budget: < 3 minutes on one H200 (the launches of
one phase run at once).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT / "tests", ROOT / "tests" / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
from _launch import run_all  # noqa: E402

EXAMPLES = ROOT / "examples"
LIGHTNING_SCRIPT = ROOT / "tests" / "scripts" / "lightning_train.py"
GPU_YAML = EXAMPLES / "accelerate_fsdp_gpu.yaml"
STEPS, SAVE_AT = 8, 4
ROWS: list[dict] = []


def emit(check: str, ok: bool, t0: float, **facts) -> None:
    row = dict(check=check, ok=bool(ok), s=round(time.perf_counter() - t0, 1), **facts)
    ROWS.append(row)
    print("GPU_CHECK_JSON " + json.dumps(row), flush=True)


class Launches:
    """Commands started together (``_launch.run_all``: clean environment, own session, killed on timeout)."""

    def __init__(self, dry: bool, timeout: float):
        self.dry, self.timeout = dry, timeout
        # tests' clean_env hides the GPUs (CUDA_VISIBLE_DEVICES=""); here the first one is the device under test
        self.env = {"PYTHONWARNINGS": "ignore"} | ({} if dry else {"CUDA_VISIBLE_DEVICES": "0"})

    def run(self, named: dict[str, list]) -> dict[str, tuple[int, str]]:
        names = list(named)
        try:
            outs = run_all([[str(a) for a in named[n]] for n in names], timeout=self.timeout, cwd=ROOT, env=self.env)
        except AssertionError as e:  # a timeout: every command of the phase was killed
            return {n: (124, str(e)) for n in names}
        return dict(zip(names, outs))


# ------------------------------------------------------------------------------------------------ Lightning
def lightning_cmd(out: Path, strategy: str, precision: str, dry: bool, *extra) -> list:
    return [sys.executable, LIGHTNING_SCRIPT, "--out", out, "--strategy", strategy, "--precision", precision,
            "--devices", 1, "--accelerator", "cpu" if dry else "gpu", "--max-steps", STEPS, *extra]


def lightning_runs(tmp: Path, dry: bool) -> tuple[dict, dict]:
    """Phase-1 and phase-2 commands of the three Lightning checks: {name: argv}."""
    stock_fsdp = "stock_fsdp" if dry else "fsdp"  # Lightning's FSDPStrategy (the script's CPU subclass on --dry)
    first, second = {}, {}
    for check, precision, reference in (("lightning_32", "32-true", "ddp"), ("lightning_bf16", "bf16-mixed", stock_fsdp),
                                        ("lightning_16", "16-mixed", stock_fsdp)):
        if dry and precision == "16-mixed":
            continue
        d = tmp / check
        d.mkdir()
        first[f"{check}/ours"] = lightning_cmd(d / "ours.json", "fsdp_plugin", precision, dry,
                                               "--save-at", SAVE_AT, d / "step4.ckpt")
        first[f"{check}/ref"] = lightning_cmd(d / "ref.json", reference, precision, dry)
        second[f"{check}/resumed"] = lightning_cmd(d / "resumed.json", "fsdp_plugin", precision, dry,
                                                   "--resume", d / "step4.ckpt")
    return first, second


def _report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _losses(report: dict) -> list[float]:
    return [e[1] for e in report["losses"]]


def _diff(a: list, b: list) -> float:
    """Max |a - b| over the steps, relative to the loss scale (max(1, |b|)), as tests/test_lightning_integration's
    ``_close`` measures it."""
    if len(a) != len(b) or not a:
        return math.inf
    return max(abs(x - y) for x, y in zip(a, b)) / max(1.0, max(abs(y) for y in b))


def lightning_verdicts(tmp: Path, outs: dict, t0: float, dry: bool) -> None:
    for check, precision, tol_ref in (("lightning_32", "32-true", 1e-5), ("lightning_bf16", "bf16-mixed", 2e-2),
                                      ("lightning_16", "16-mixed", 2e-2)):
        if dry and precision == "16-mixed":
            emit(check, True, t0, precision=precision, skipped="--dry: Lightning's 16-mixed is CUDA-only")
            continue
        d = tmp / check
        ours, ref, resumed = (_report(d / f"{n}.json") for n in ("ours", "ref", "resumed"))
        failed = {n: outs[f"{check}/{n}"][1][-3000:] for n in ("ours", "ref", "resumed")
                  if outs[f"{check}/{n}"][0] != 0 or _report(d / f"{n}.json") is None}
        if failed:
            emit(check, False, t0, precision=precision, error=failed)
            continue
        a, r, b = _losses(ours), _losses(ref), _losses(resumed)
        steps_resumed = [e[0] for e in resumed["losses"]]
        finite = all(math.isfinite(x) for x in a + b)
        vs_ref = _diff(a, r)
        vs_ref_resumed = _diff(b, r[SAVE_AT:])
        resume_exact = _diff(b, a[SAVE_AT:])
        ok = (finite and steps_resumed == list(range(SAVE_AT + 1, STEPS + 1)) and vs_ref <= tol_ref
              and vs_ref_resumed <= tol_ref and resume_exact <= (1e-5 if precision == "32-true" else 1e-3))
        facts = dict(precision=precision, reference=ref["strategy"], device=ours.get("device"),
                     max_diff_vs_reference=vs_ref, max_diff_resumed_vs_reference=vs_ref_resumed,
                     max_diff_resumed_vs_straight=resume_exact, tol=tol_ref, finite=finite,
                     resumed_steps=steps_resumed, losses=[round(x, 6) for x in a])
        if precision == "16-mixed":
            facts["scaler"] = ours.get("scaler")
            ok = ok and ours.get("scaler", "").endswith("GradScaler") and "fsdp_plugin" in ours.get("scaler", "")
        emit(check, ok, t0, **facts)


# ------------------------------------------------------------------------------------- accelerate launch runs
def accelerate_cmd(script: str, nproc: int, *args) -> list:
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", GPU_YAML,
            "--num_processes", nproc, "--main_process_port", 0, EXAMPLES / script, *args]


def launch_runs(tmp: Path, nproc: int) -> tuple[dict, dict]:
    first = {
        "accelerate/first": accelerate_cmd("accelerate_train.py", nproc, "--steps", 4, "--save-state", tmp / "acc"),
        "trainer": accelerate_cmd("hf_trainer.py", nproc, "--out", tmp / "sft", "--max-steps", 5, "--save-steps", 5,
                                  "--bf16"),
        "peft_lora": accelerate_cmd("peft_lora.py", nproc, "--out", tmp / "lora", "--max-steps", 4),
    }
    second = {"accelerate/resumed": accelerate_cmd("accelerate_train.py", nproc, "--steps", 6, "--resume", tmp / "acc")}
    return first, second


def _hardware_line(out: str) -> str:
    """The example's first line (another rank's progress bar may share its line of the merged output)."""
    import re

    m = re.search(r"fsdp_plugin example: [^\r\n]*", out)
    return m.group(0) if m else ""


def _device_ok(line: str, dry: bool) -> bool:
    return ("CPU process" in line) if dry else ("x CUDA" in line)


def launch_verdicts(tmp: Path, outs: dict, t0: float, dry: bool) -> None:
    import re

    if "accelerate/first" in outs:
        (rc1, o1), (rc2, o2) = outs["accelerate/first"], outs["accelerate/resumed"]
        losses = [float(x) for x in re.findall(r"^step\s+\d+\s+loss ([0-9.naif]+)", o1 + o2, re.M)]
        line = _hardware_line(o1)
        ok = (rc1 == rc2 == 0 and "trained steps 1..4" in o1 and "resumed from" in o2 and "trained steps 5..6" in o2
              and _device_ok(line, dry) and "bf16-mixed" in line and len(losses) == 6
              and all(math.isfinite(x) for x in losses))
        emit("accelerate", ok, t0, config=GPU_YAML.name, hardware=line, losses=losses,
             **({} if ok else {"tail": (o1[-2000:], o2[-2000:])}))
    if "trainer" in outs:
        trainer_verdict(tmp, outs, t0, dry)
    if "peft_lora" in outs:
        peft_verdict(outs, t0, dry)


def trainer_verdict(tmp: Path, outs: dict, t0: float, dry: bool) -> None:
    import re

    rc, out = outs["trainer"]
    line = _hardware_line(out)
    m = re.search(r"losses=\[([^\]]*)\]", out)
    losses = [float(x) for x in m.group(1).split(",") if x.strip()] if m else []
    ok = (rc == 0 and "sharded=True step 5 (started at 0)" in out and _device_ok(line, dry) and "bf16" in line
          and bool(losses) and all(math.isfinite(x) for x in losses)       # logging_steps=5: the loss of step 5
          and (tmp / "sft" / "checkpoint-5" / "fsdp_plugin_state" / "manifest.json").is_file()
          and (tmp / "sft" / "final" / "config.json").is_file())
    emit("trainer", ok, t0, config=GPU_YAML.name, hardware=line, losses=losses, **({} if ok else {"tail": out[-3000:]}))


def peft_verdict(outs: dict, t0: float, dry: bool) -> None:
    import re

    rc, out = outs["peft_lora"]
    line = _hardware_line(out)
    m = re.search(r"max \|logits merged - adapter\| = (\S+)", out)
    diff = float(m.group(1)) if m else math.inf
    ok = rc == 0 and "sharded=True" in out and "frozen_grads=0" in out and diff <= 1e-4 and _device_ok(line, dry)
    emit("peft_lora", ok, t0, config=GPU_YAML.name, hardware=line, merged_vs_adapter=diff,
         **({} if ok else {"tail": out[-3000:]}))


# ------------------------------------------------------------------------------------------ TRL weight sync
def trl_worker(tmp: str, dry: bool) -> None:
    """One trainer rank (world 1: NCCL on the GPU, gloo on --dry): GRPO's sync_weights in server mode (policy in
    fp32) and in colocate mode (LoRA policy, merged), twice each; writes what the stand-ins got and the truth."""
    import multiprocessing as mp

    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    import test_trl_vllm_sync as t  # the test's stand-ins (FakeVLLMClient, _receiver, _Colocated) and model

    import fsdp_plugin as fp
    import fsdp_plugin.integrations.transformers as integration
    import trl.generation.vllm_generation as vg

    integration.install()
    assert getattr(vg.VLLMGeneration._iter_named_params, "__fsdp_plugin__", False), "TRL's sync is not patched"
    # the receiver first (forked before CUDA is touched): it joins rank 0 on its own gloo group, on the CPU
    proc = mp.get_context("fork").Process(target=t._receiver, args=(f"{tmp}/side", f"{tmp}/got.safetensors"))
    proc.start()
    if dry:
        device = torch.device("cpu")
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
    else:
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)

    class HostClient(t.FakeVLLMClient):
        """The stand-in server's wire is gloo (CPU): tensors cross to the host first, as bytes they are the same."""

        def update_named_params(self, metadata, named_params):
            super().update_named_params(metadata, ((n, w.cpu()) for n, w in named_params))

    def step(model):
        ids = torch.randint(0, t._CFG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    report = {}
    for mode, lora in (("server", False), ("colocate", True)):
        client = HostClient(t._side_group(f"{tmp}/side", 0)) if mode == "server" else None
        llm = t._Colocated() if mode == "colocate" else None
        policy = fp.shard(t._lora(t._llama()) if lora else t._llama())
        ref = fp.shard(t._llama(seed=7).requires_grad_(False).eval())   # a frozen reference model alongside
        step(policy)
        with torch.no_grad():
            ref(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device))
        t._sync("grpo", policy, mode, client, llm)
        t._sync("grpo", policy, mode, client, llm)
        report[mode] = dict(device=str(next(policy.parameters()).device), lora=lora)
        full = fp.full_state_dict(policy, rank0_only=False)
        save_file({k: v.detach().cpu().clone() for k, v in full.items()}, f"{tmp}/{mode}_full.safetensors")
        if client is not None:
            client.close()
            proc.join(timeout=60)
            report[mode]["receiver_exit"] = proc.exitcode
        else:
            save_file({k: v.detach().cpu().clone() for k, v in llm.got.items()}, f"{tmp}/colocate_got.safetensors")
    Path(tmp, "trl.json").write_text(json.dumps(report))
    fp.shutdown()


def trl_verdict(tmp: Path, rc_out: tuple[int, str], t0: float) -> None:
    rc, out = rc_out
    report = _report(tmp / "trl.json")
    if rc != 0 or report is None:
        emit("trl_grpo_sync", False, t0, error=out[-3000:])
        return
    import shutil

    from safetensors.torch import load_file

    import test_trl_vllm_sync as t

    facts, ok = {}, True
    for mode, lora, got_file in (("server", False, "got.safetensors"), ("colocate", True, "colocate_got.safetensors")):
        shutil.copy(tmp / f"{mode}_full.safetensors", tmp / "full.safetensors")   # where the test's _expected reads
        try:
            t._compare(load_file(tmp / got_file), t._expected(str(tmp), lora))
            facts[mode] = dict(report[mode], equal=True)
        except AssertionError as e:
            ok = False
            facts[mode] = dict(report[mode], equal=False, error=str(e)[:500])
    ok = ok and report["server"].get("receiver_exit") == 0
    emit("trl_grpo_sync", ok, t0, **facts)


# ------------------------------------------------------------------------------------------------------ main
# what each check imports beyond torch: a machine without one (a GPU image may lack trl or datasets) gets a failing
# row naming it at once, and the other checks still run
NEEDS = {"lightning": ("lightning",), "accelerate": ("accelerate",),
         "trainer": ("accelerate", "transformers", "trl", "datasets"),
         "peft_lora": ("accelerate", "transformers", "peft", "datasets"), "trl": ("transformers", "trl", "peft")}


def missing(check: str) -> list[str]:
    import importlib.util

    return [m for m in NEEDS[check] if importlib.util.find_spec(m) is None]


def runnable(named: dict, t0: float) -> dict:
    """``named`` without the launches of checks whose packages are missing (a failing row each, once)."""
    keep, said = {}, set()
    for name, cmd in named.items():
        check = name.split("/")[0]
        group = "lightning" if check.startswith("lightning") else check
        gone = missing(group)
        if not gone:
            keep[name] = cmd
        elif check not in said:
            said.add(check)
            emit("trl_grpo_sync" if check == "trl" else check, False, t0,
                 error=f"not installed here: {', '.join(gone)} (install it to run this check)")
    return keep


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="CPU (gloo) instead of the GPU: a rehearsal")
    ap.add_argument("--trl-worker", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker, args.dry)
        return 0
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("entry_points: no CUDA device here; run it on a GPU machine, or --dry to rehearse on CPU")
        return 1
    nproc = 2 if args.dry else 1   # --dry: 2 CPU processes; on the device: world 1 (one H200)
    launches = Launches(args.dry, timeout=600 if args.dry else 150)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        (tmp / "trl").mkdir()
        t0 = time.perf_counter()
        l1, l2 = lightning_runs(tmp, args.dry)
        a1, a2 = launch_runs(tmp, nproc)
        trl = {"trl": [sys.executable, Path(__file__).resolve(), "--trl-worker", tmp / "trl"]
               + (["--dry"] if args.dry else [])}
        first, second = runnable(l1 | a1 | trl, t0), runnable(l2 | a2, t0)
        outs = launches.run(first)                         # phase 1: everything that starts from nothing
        outs |= launches.run(second)                       # phase 2: the resumes
        if not missing("lightning"):
            lightning_verdicts(tmp, outs, t0, args.dry)
        launch_verdicts(tmp, outs, t0, args.dry)
        if "trl" in outs:
            trl_verdict(tmp / "trl", outs["trl"], t0)
    failed = [r["check"] for r in ROWS if not r["ok"]]
    print(f"entry_points: {len(ROWS) - len(failed)}/{len(ROWS)} passed in {time.perf_counter() - t0:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
