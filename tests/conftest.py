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


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup``, the tests of a module that share a module- or class-scoped
    fixture (a trained run, an exported checkpoint) go to one xdist worker, so the fixture is built once
    (a test using two such fixtures goes with the first by name; the other may then be built twice)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = sorted(info.name2fixturedefs.items()) if info is not None else ()
        shared = [name for name, d in defs if d and d[-1].scope in ("module", "class")]
        if shared:  # one group per fixture: a module's independent fixtures still spread over workers
            item.add_marker(pytest.mark.xdist_group(f"{item.nodeid.split('::')[0]}::{shared[0]}"))
