"""Serve ``fsdp_plugin.integrations.pytorch_lightning.X`` from ``fsdp_plugin.integrations.lightning.X``'s source.

The renames are the ones Lightning uses to build its standalone packages from the unified one
(``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` -> ``lightning_fabric``), plus our own
package name, so that a mirrored module imports mirrored siblings and never the ``lightning`` package. The
code objects keep the original file name: tracebacks point at the file to edit.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

_SOURCE_PACKAGE = "fsdp_plugin.integrations.lightning"
_RENAMES = (  # order matters: our package name contains "lightning"
    (_SOURCE_PACKAGE, "\0MIRROR\0"),
    ("lightning.pytorch", "pytorch_lightning"),
    ("lightning.fabric", "lightning_fabric"),
)


def rewrite(source: str, mirror_package: str) -> str:
    """``source`` with Lightning's standalone renames applied and our package renamed ``mirror_package``."""
    for old, new in _RENAMES:
        source = source.replace(old, new)
    return source.replace("\0MIRROR\0", mirror_package)


class _Loader(importlib.abc.SourceLoader):
    def __init__(self, origin: str, mirror_package: str) -> None:
        self.origin = origin
        self.mirror_package = mirror_package

    def get_filename(self, fullname: str) -> str:
        return self.origin

    def get_data(self, path: str) -> bytes:
        with open(path, encoding="utf-8") as f:
            return rewrite(f.read(), self.mirror_package).encode("utf-8")

    def path_stats(self, path: str) -> Any:  # no bytecode cache: the cache would be keyed on the original file
        raise OSError("mirrored modules are not cached")


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, mirror_package: str) -> None:
        self.prefix = mirror_package + "."
        self.mirror_package = mirror_package

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not fullname.startswith(self.prefix) or fullname.rsplit(".", 1)[-1] == "_mirror":
            return None
        source = importlib.util.find_spec(_SOURCE_PACKAGE + "." + fullname[len(self.prefix):])
        if source is None or not source.has_location or not str(source.origin).endswith(".py"):
            return None
        is_package = source.submodule_search_locations is not None
        return importlib.util.spec_from_file_location(
            fullname, source.origin, loader=_Loader(source.origin, self.mirror_package),
            submodule_search_locations=[] if is_package else None)


def install(mirror_package: str) -> None:
    """Resolve ``mirror_package``'s submodules from the Lightning integration's sources (idempotent)."""
    if not any(isinstance(f, _Finder) and f.mirror_package == mirror_package for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(mirror_package))
