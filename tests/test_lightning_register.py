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
