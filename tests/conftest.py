import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

# Meta-tensor arithmetic under fp.deferred_init() imports torch._dynamo once (~8 s on this machine);
# importing it here lets every forked rank inherit it instead of paying it again.
import torch._dynamo  # noqa: E402,F401

from _ci_skips import (pytest_collectreport, pytest_runtest_logreport,  # noqa: E402,F401 - hooks of the CI gate
                       pytest_sessionfinish, pytest_terminal_summary)
