"""The supported torch range is checked at import, and version-dependent torch APIs live in one module.

``fsdp_plugin/_compat.py`` is the only module that knows torch versions: it picks the available name of each API
that differs across the supported range. These tests keep it that way and check its forms on the running torch
(CI's lanes run them on the oldest and the newest supported torch too).
"""
import ast
import pathlib
import subprocess
import sys

import pytest
import torch

from _dist import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]
# torch.__version__ may be *recorded* (a checkpoint's producer field), never branched on, outside _compat
RECORDS_VERSION = {"fsdp_plugin/checkpoint/save.py"}
RENAMED = {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"}


def _sources():
    for base in ("fsdp_plugin", "integrations"):
        for path in (ROOT / base).rglob("*.py"):
            yield path.relative_to(ROOT).as_posix(), ast.parse(path.read_text())


@pytest.mark.parametrize("version", ["2.10.0", "2.9.1+cu128", "2.4.1", "1.13.0"])
def test_a_torch_below_the_range_is_one_clear_import_error(version):
    from fsdp_plugin import _compat
    with pytest.raises(ImportError, match=r"torch >= 2\.11.*" + version.replace("+", r"\+")):
        _compat.check_torch(version)


@pytest.mark.parametrize("version", ["2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.16.0.dev20261201", "3.0.0"])
def test_supported_torch_imports(version):
    from fsdp_plugin import _compat
    _compat.check_torch(version)


def test_import_fsdp_plugin_under_an_old_torch_names_the_range():
    """End to end: ``import fsdp_plugin`` with an older torch fails at the import, naming the range and the fix."""
    code = "import torch; torch.__version__ = '2.10.1'; import fsdp_plugin"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fsdp_plugin needs torch >= 2.11; this environment has torch 2.10.1"), last
    assert "pip install" in last


def test_pyproject_states_the_same_floor():
    from fsdp_plugin import _compat
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"torch>={_compat.SUPPORTED[0]}.{_compat.SUPPORTED[1]}"' in text


def test_no_module_but_compat_reads_the_torch_version_or_the_renamed_collectives():
    found = []
    for rel, tree in _sources():
        if rel == "fsdp_plugin/_compat.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "__version__" and \
                    isinstance(node.value, ast.Name) and node.value.id == "torch" and rel not in RECORDS_VERSION:
                found.append(f"{rel}:{node.lineno} torch.__version__")
            if isinstance(node, ast.Attribute) and node.attr in RENAMED:
                found.append(f"{rel}:{node.lineno} {node.attr}")
            if isinstance(node, ast.Constant) and node.value in RENAMED:
                found.append(f"{rel}:{node.lineno} '{node.value}'")
    assert not found, "use fsdp_plugin._compat instead: " + ", ".join(found)


def _shim_worker(rank, world):
    from fsdp_plugin import _compat
    mine = torch.full((3,), float(rank + 1))
    out = torch.empty(3 * world)
    _compat.all_gather_into(out, mine)
    summed = torch.empty(2)
    _compat.reduce_scatter_into(summed, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    work = _compat.all_gather_into(out.clone(), mine, async_op=True)
    work.wait()
    return out.tolist(), summed.tolist()


def test_native_collective_forms_work_on_this_torch():
    """The form _compat picked runs on gloo, synchronously and asynchronously (2.11: the *_tensor names)."""
    world = 2
    for rank, (gathered, summed) in enumerate(run_ranks(_shim_worker, world, timeout=60)):
        assert gathered == [1.0] * 3 + [2.0] * 3
        # rank r keeps elements [2r, 2r+2) of sum_k (k+1) * arange: 3 * arange
        assert summed == [3.0 * (2 * rank), 3.0 * (2 * rank + 1)]
