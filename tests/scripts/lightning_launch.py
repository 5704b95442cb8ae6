"""Run a multi-process Lightning/Fabric/torchrun script from a test: clean env, process-group kill on timeout.

Lightning's launcher re-runs ``sys.argv`` for the other ranks, so multi-device Trainers must never run
inside the pytest process; each one runs here, in its own session, and a timeout kills the whole group
(launcher and every rank it started).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "STANDALONE_PORT")
_DIST_PREFIXES = ("ACCELERATE_USE_", "FSDP_", "SLURM_", "PMI_", "OMPI_", "PL_")


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The current environment without launcher/cluster variables, one thread per rank, unbuffered."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith(_DIST_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


def run(args: list[str], timeout: float = 120.0, cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None) -> str:
    """Run ``args``; return its combined output, or raise AssertionError with the output's tail."""
    proc = subprocess.Popen(args, cwd=cwd, env=clean_env(env), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(args)} timed out after {timeout:.0f}s:\n{_tail(out)}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited with {proc.returncode}:\n{_tail(out)}")
    return out


def python(script: str, *args: str, timeout: float = 120.0, cwd=None) -> str:
    """``python tests/scripts/<script> args...`` with this interpreter."""
    return run([sys.executable, str(SCRIPTS / script), *map(str, args)], timeout=timeout, cwd=cwd)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 120.0, cwd=None) -> str:
    """``torchrun --standalone --nproc_per_node N tests/scripts/<script> args...``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPTS / script), *map(str, args)]
    return run(cmd, timeout=timeout, cwd=cwd)


def report(path: str | os.PathLike) -> dict:
    """The JSON a script wrote (rank 0)."""
    with open(path) as f:
        return json.load(f)


def _tail(out: str | None, lines: int = 60) -> str:
    return "\n".join((out or "").splitlines()[-lines:])
