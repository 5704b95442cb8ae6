"""Run launcher commands (torchrun, lightning, accelerate launch) in subprocesses with a clean
environment, killing the whole process group on timeout."""
import os
import signal
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra) -> dict:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", *map(str, args)]


def run_all(commands: list, timeout: float = 180, env: dict | None = None) -> list:
    """Start every command at once (own process groups); wait for all; kill all on timeout."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=env or clean_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for c in commands]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise AssertionError(f"launcher timed out after {timeout}s: {commands}")
    return [(p.returncode, out) for p, out in zip(procs, outs)]
