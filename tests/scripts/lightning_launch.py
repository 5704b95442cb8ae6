"""Run a multi-process Lightning/Fabric/torchrun script from a test: clean env, process-group kill on timeout.

Lightning's launcher re-runs ``sys.argv`` for the other ranks, so multi-device Trainers must never run
inside the pytest process; each one runs here, in its own session, and a timeout kills the whole group
(launcher and every rank it started).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent))
from _launch import clean_env as _clean_env, run as _run  # noqa: E402


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The launch environment, with Python warnings off (Lightning's are noise in these logs)."""
    return _clean_env({"PYTHONWARNINGS": "ignore", **(extra or {})})


def run(args: list[str], timeout: float = 120.0, cwd: str | os.PathLike | None = None,
        env: dict[str, str] | None = None) -> str:
    """Run ``args``; return its combined output, or raise AssertionError with the output's tail."""
    return _run(args, timeout=timeout, cwd=cwd, env={"PYTHONWARNINGS": "ignore", **(env or {})})


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
