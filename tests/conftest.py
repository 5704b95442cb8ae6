import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

# Meta-tensor arithmetic under fp.deferred_init() imports torch._dynamo once (~8 s on this machine);
# importing it here lets every forked rank inherit it instead of paying it again.
import torch._dynamo  # noqa: E402,F401

import pytest  # noqa: E402

from _ci_skips import (pytest_collectreport, pytest_runtest_logreport,  # noqa: E402,F401 - hooks of the CI gate
                       pytest_sessionfinish, pytest_terminal_summary)


def _shared_fixtures(item) -> list[str]:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.items() if info is not None else ()
    return sorted(name for name, d in defs if d and d[-1].scope in ("module", "class"))


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup``, the tests of a module that share a module- or class-scoped
    fixture (a trained run, an exported checkpoint) go to one xdist worker, so each such fixture is built once:
    fixtures used together by some test join one group (union-find per module); other tests spread freely."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keyed = []
    for item in items:
        module = item.nodeid.split("::")[0]
        keys = [f"{module}::{name}" for name in _shared_fixtures(item)]
        for k in keys[1:]:
            parent[root(k)] = root(keys[0])
        keyed.append((item, keys))
    for item, keys in keyed:
        if keys:
            item.add_marker(pytest.mark.xdist_group(root(keys[0])))
