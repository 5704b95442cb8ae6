"""CI runs every test: ``.ci/run`` runs the README's whole-suite command with the no-skip gate on
(tests/_ci_skips.py), and the gate fails a run that skips or xfails a test off its allow-list.

The gate's cases run an inner pytest on a tiny throwaway test file (no torch import: ~1 s each), once under
pytest-xdist, as CI runs it: its skips are reported by the workers and judged by the controller."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import _readme

TESTS = Path(__file__).resolve().parent
CASES = '''
import pytest

def test_passes():
    pass

def test_skips():
    pytest.skip("needs a package that is not installed")

@pytest.mark.skip(reason="needs CUDA")
def test_gpu_only():
    pass

@pytest.mark.xfail(reason="known bug", strict=False)
def test_xfails():
    assert False
'''


def _inner(tmp_path: Path, select: str, gate: bool, *extra: str) -> tuple[int, str]:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "FSDP_CI_NO_SKIP" and not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(TESTS), **({"FSDP_CI_NO_SKIP": "1"} if gate else {}))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "_ci_skips", "-p", "no:cacheprovider", "-k", select, *extra]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def test_a_skip_off_the_allow_list_fails_the_run(tmp_path):
    rc, out = _inner(tmp_path, "passes or skips or gpu", True)
    assert rc == 1, out
    assert "SKIP test_cases.py::test_skips: Skipped: needs a package that is not installed" in out, out
    assert "test_gpu_only" not in out.split("FSDP_CI_NO_SKIP:")[1], out  # allow-listed: "needs CUDA"
    assert re.search(r"^1 passed, 2 skipped\b", out, re.M), out  # pytest's own closing line still counts


def test_an_xfail_fails_the_run_and_the_gate_works_under_xdist(tmp_path):
    rc, out = _inner(tmp_path, "passes or xfails", True, "-n", "2")
    assert rc == 1 and "XFAIL test_cases.py::test_xfails: known bug" in out, out
    assert re.search(r"^1 passed, 1 xfailed\b", out, re.M), out


def test_allow_listed_skips_pass_and_the_gate_is_off_by_default(tmp_path):
    rc, out = _inner(tmp_path, "passes or gpu", True)
    assert rc == 0 and "FSDP_CI_NO_SKIP:" not in out, out
    rc, out = _inner(tmp_path, "passes or skips or xfails", False)
    assert rc == 0 and "FSDP_CI_NO_SKIP:" not in out, out


def test_ci_runs_the_readme_whole_suite_command_with_the_gate():
    script = (_readme.ROOT / ".ci" / "run").read_text()
    suite = [c for c in _readme.commands() if c.startswith("python -m pytest") and "-m" not in c.split()[3:]]
    assert len(suite) == 1, suite  # the one whole-suite command: no -m selection, slow campaigns included
    assert re.search(rf"^{re.escape(suite[0])}$", script, re.M), suite[0]
    assert re.search(r"^export FSDP_CI_NO_SKIP=1$", script, re.M)
    assert re.search(r"\s-n\s+\d+", suite[0]) and "--dist loadfile" in suite[0], suite[0]

