"""``import fsdp_plugin`` registers "fsdp_plugin" with Lightning (Trainer and Fabric), lazily, in any order.

Each check runs in a fresh interpreter (registration is process-global import state).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import lightning_launch as launch

pytest.importorskip("lightning")

_CHECK = """
import sys
{first}
assert "lightning" not in sys.modules, "registration imported Lightning eagerly"
{second}
from lightning.pytorch.strategies import StrategyRegistry
from lightning.fabric.strategies import STRATEGY_REGISTRY
assert "fsdp_plugin" in StrategyRegistry and "fsdp_plugin" in STRATEGY_REGISTRY
assert "fsdp_plugin.integrations.lightning.strategy" not in sys.modules, "strategy imported before it was asked for"
s = StrategyRegistry.get("fsdp_plugin")
f = STRATEGY_REGISTRY.get("fsdp_plugin")
print("OK", type(s).__name__, type(f).__name__)
"""


def _run(first: str, second: str) -> str:
    return launch.run([sys.executable, "-c", _CHECK.format(first=first, second=second)], timeout=120)


def test_import_fsdp_plugin_registers_lazily():
    """Needs ``fsdp_plugin/__init__.py`` to call ``register_if_lightning_present()``. The other order
    (Lightning imported first) is what tests/scripts/lightning_*.py do."""
    out = _run("import fsdp_plugin", "import lightning.pytorch, lightning.fabric")
    assert "OK FSDPPluginStrategy FSDPPluginFabricStrategy" in out


_STANDALONE_CHECK = """
import sys
import fsdp_plugin
import pytorch_lightning as pl, lightning_fabric
s = pl.strategies.StrategyRegistry.get("fsdp_plugin")
f = lightning_fabric.strategies.STRATEGY_REGISTRY.get("fsdp_plugin")
assert isinstance(s, pl.strategies.Strategy) and isinstance(f, lightning_fabric.strategies.Strategy)
assert isinstance(s.precision_plugin, pl.plugins.precision.Precision), type(s.precision_plugin).__mro__
assert not [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")], "the unified package was imported"
print("OK", type(s).__module__, type(f).__module__)
"""


def test_standalone_pytorch_lightning_registers_its_own_classes():
    """``pytorch_lightning``'s Trainer accepts only subclasses of its own Strategy: the registry entry builds the
    mirrored class, and the unified ``lightning`` package is never imported."""
    pytest.importorskip("pytorch_lightning")
    out = launch.run([sys.executable, "-c", _STANDALONE_CHECK], timeout=120)
    assert ("OK fsdp_plugin.integrations.pytorch_lightning.strategy "
            "fsdp_plugin.integrations.pytorch_lightning.fabric") in out, out


@pytest.mark.integration
def test_pytorch_lightning_trainer_two_ranks_matches_single_process(tmp_path):
    """``import pytorch_lightning as pl; pl.Trainer(strategy="fsdp_plugin", devices=2)``: the same losses as one
    plain PyTorch process on the global batch (lightning_train.py's reference), step by step."""
    pytest.importorskip("pytorch_lightning")
    import lightning_train as lt

    out = tmp_path / "out.json"
    launch.python("lightning_train.py", "--out", out, "--devices", 2, "--max-steps", 4,
                  "--package", "pytorch_lightning", timeout=240)
    report = launch.report(out)
    assert report["trainer_module"].startswith("pytorch_lightning.") and not report["lightning_imported"]
    assert report["strategy_module"] == "fsdp_plugin.integrations.pytorch_lightning.strategy"
    assert report["precision_plugin"] == "FSDPPluginPrecision" and report["world_size"] == 2
    got, want = [e[1] for e in report["losses"]], lt.reference_run(4)[0]
    assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5 * max(1.0, *map(abs, want)), (got, want)
