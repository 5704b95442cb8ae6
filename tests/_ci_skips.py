"""CI's no-skip gate: under ``FSDP_CI_NO_SKIP=1`` (``.ci/run`` sets it) a skipped or xfailed test fails the run.

A skip hides a promise from CI exactly as a deleted test would, so the gate counts every skipped test, every
collection-level skip (a module's ``importorskip``), every xfail and xpass, and sets pytest's exit status to 1
when any of them has a reason that no entry of ``ALLOWED`` matches. The allow-list is short on purpose: only
tests that cannot run on CI's CPU-only machine (README, "Tests and benchmarks"). Under pytest-xdist the
controller sees every worker's reports, so the gate runs there (and not in the workers).
"""
from __future__ import annotations

import os
import re

import pytest

ENV = "FSDP_CI_NO_SKIP"
# Reasons a test may skip in CI (regular expressions, searched in the reason): CPU-only CI machine.
ALLOWED = (r"\b(CUDA|GPU|NCCL)\b",)

_FOUND: list[tuple[str, str, str]] = []  # (kind, test id, reason) of every skip/xfail not allowed


def _active(config) -> bool:
    return os.environ.get(ENV) == "1" and not hasattr(config, "workerinput")  # not inside an xdist worker


def _reason(report) -> tuple[str, str] | None:
    """``(kind, reason)`` of a skipped/xfailed/xpassed report, None for a plain pass or failure."""
    if hasattr(report, "wasxfail"):
        return ("xfail" if report.skipped else "xpass"), str(report.wasxfail)
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return "skip", reason
    return None


def _note(report) -> None:
    found = _reason(report)
    if found and not any(re.search(p, found[1]) for p in ALLOWED):
        _FOUND.append((found[0], report.nodeid, found[1]))


def pytest_runtest_logreport(report) -> None:
    if os.environ.get(ENV) == "1" and (report.when == "call" or report.skipped):
        _note(report)


def pytest_collectreport(report) -> None:
    if os.environ.get(ENV) == "1" and report.skipped:
        _note(report)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if _active(session.config) and _FOUND and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _active(config) or not _FOUND:
        return
    tr = terminalreporter
    tr.section(f"{ENV}: {len(_FOUND)} skipped/xfailed test(s) not on the allow-list (tests/_ci_skips.py)", red=True)
    for kind, nodeid, reason in _FOUND:
        tr.line(f"{kind.upper()} {nodeid}: {reason}")
    tr.line("CI runs every test: install what the test needs, or fix it; only GPU-only skips are allowed.")
