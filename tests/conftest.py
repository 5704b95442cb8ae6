import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))

# Meta-tensor arithmetic under fp.deferred_init() imports torch._dynamo once (~8 s on this machine);
# importing it here lets every forked rank inherit it instead of paying it again.
import torch._dynamo  # noqa: E402,F401

# torch 2.11: a process's first backward on fake tensors (fp.plan, torch.compile's tracing) starts autograd's
# device threads, after which every fork-based rank (tests/_dist.run_ranks) fails its backward. The planner's
# workaround (one real CPU backward first), here too, keeps forked ranks working on every torch.
from fsdp_plugin import _compat  # noqa: E402

_compat.start_autograd_engine()

from _ci_skips import (pytest_collectreport, pytest_runtest_logreport,  # noqa: E402,F401 - hooks of the CI gate
                       pytest_sessionfinish, pytest_terminal_summary)
