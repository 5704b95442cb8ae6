"""The one way tests start launchers (torchrun, Lightning, accelerate launch): a subprocess in its own
session with a clean environment; a timeout kills the whole process group (launcher and every rank)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
              "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PL_GLOBAL_SEED", "STANDALONE_PORT",
              "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")
_DIST_PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "SLURM_", "PMI_", "OMPI_", "PL_", "LIGHTNING_",
                  "TORCHELASTIC_", "TORCH_ELASTIC")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(extra: dict | None = None) -> dict:
    """The parent's environment without launcher/cluster variables; one thread per rank, CPU only."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith(_DIST_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]


def _tail(out: str | None, lines: int = 60) -> str:
    return "\n".join((out or "").splitlines()[-lines:])


def kill_all(procs: list) -> None:
    """SIGKILL every process group of ``procs`` (started with ``start_new_session=True``)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_all(commands: list, timeout: float = 180, cwd=ROOT, env: dict | None = None) -> list:
    """Start every command at once; return ``[(returncode, output)]``; kill all of them on timeout."""
    procs = [subprocess.Popen(c, cwd=cwd, env=clean_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for c in commands]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        kill_all(procs)
        raise AssertionError(f"launcher timed out after {timeout:.0f}s: {commands}\n"
                             f"{_tail(procs[len(outs)].communicate()[0])}") from None
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def run(args: list, timeout: float = 120.0, cwd=ROOT, env: dict | None = None) -> str:
    """Run one command; return its combined output, or raise AssertionError with the output's tail."""
    (rc, out), = run_all([list(map(str, args))], timeout=timeout, cwd=cwd, env=env)
    if rc != 0:
        raise AssertionError(f"{' '.join(map(str, args))} exited with {rc}:\n{_tail(out)}")
    return out
