"""The README's commands, read from README.md itself, and how the tests run them.

A command is a line of a ```bash block (split at ``&&``; a trailing ``# comment`` dropped) or an inline code
span that starts with a program (``python``, ``torchrun``, ``accelerate``, ``fsdp-plugin``). The tests run
them *as written*, with two kinds of change only, both explicit here:

* the fast variant: every step count (``--steps``, ``--max-steps``, ``checkpoint-<n>``) divided by ``FAST``,
  plus flags appended (argparse keeps the last value) that shrink the model or save more often;
* isolation: ``/tmp/...`` paths move under the test's temporary directory, relative paths resolve in it
  (``examples`` there links to this tree's), and ``torchrun`` gets ``--standalone`` (a free port, not 29500).
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FAST = 10
PROGRAMS = ("python ", "python3 ", "torchrun ", "accelerate ", "fsdp-plugin ")
_STEP_FLAGS = ("--steps", "--max-steps")


def readme_text() -> str:
    return README.read_text()


def _block_commands(text: str) -> list[str]:
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            out += [part.strip() for part in line.split("&&") if part.strip()]
    return out


def _inline_commands(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return [s for s in spans if s.startswith(PROGRAMS) and len(s.split()) > 2]  # not mere names: `accelerate launch`


def commands(text: str | None = None) -> list[str]:
    """Every command the README shows, in order of appearance within blocks, then inline ones."""
    text = readme_text() if text is None else text
    return _block_commands(text) + _inline_commands(text)


def transcripts(text: str | None = None) -> list[tuple[str, str]]:
    """``(command, output)`` of every plain ``` block whose first line is ``$ command``."""
    text = readme_text() if text is None else text
    found = re.findall(r"```\n\$ ([^\n]+)\n(.*?)```", text, re.S)
    return [(cmd, out.rstrip("\n")) for cmd, out in found]


def find(pattern: str, text: str | None = None) -> list[str]:
    """The README commands matching the regular expression ``pattern`` (searched), in order."""
    return [c for c in commands(text) if re.search(pattern, c)]


def one(pattern: str) -> str:
    found = list(dict.fromkeys(find(pattern)))
    assert len(found) == 1, f"README: expected one command matching {pattern!r}, found {found}"
    return found[0]


def fast_steps(n: int) -> int:
    return max(1, n // FAST)


def _fast_word(prev: str, word: str, tmp: Path) -> str:
    if prev in _STEP_FLAGS and word.isdigit():
        word = str(fast_steps(int(word)))
    word = re.sub(r"checkpoint-(\d+)", lambda m: f"checkpoint-{fast_steps(int(m.group(1)))}", word)
    if word.startswith("/tmp/"):
        word = str(tmp / word[len("/tmp/"):])
    return word


def argv(command: str, tmp: Path, extra: tuple = (), launcher: tuple = ()) -> list[str]:
    """The command as this test process runs it (see the module docstring): ``extra`` appended (script
    flags), ``launcher`` inserted after ``accelerate launch`` (e.g. another process count)."""
    words = shlex.split(command)
    words = [_fast_word(p, w, tmp) for p, w in zip([""] + words, words)] + [str(e) for e in extra]
    head, rest = words[0], words[1:]
    if head in ("python", "python3"):
        return [sys.executable, *rest]
    if head == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", *rest]
    if head == "accelerate":
        return [sys.executable, "-m", "accelerate.commands.accelerate_cli", rest[0], *map(str, launcher), *rest[1:]]
    if head == "fsdp-plugin":
        return rest  # run in-process: fsdp_plugin.cli.main(rest)
    raise AssertionError(f"README command with an unknown program: {command}")


def workdir(tmp: Path) -> Path:
    """``tmp`` with ``examples`` linked to this tree's, so README-relative paths resolve and outputs land here."""
    link = tmp / "examples"
    if not link.exists():
        link.symlink_to(ROOT / "examples", target_is_directory=True)
    return tmp
