"""Profiler labels for the engine's state moves: ``fsdp_plugin::<what>::<unit>`` in torch.profiler traces.

One decorator per FlatParamHandle method; it reads ``self.label`` (the unit name). Free when no profiler
runs: the label is only built while ``torch.profiler`` records.
"""
from __future__ import annotations

import functools

import torch
from torch.autograd import _profiler_enabled

PREFIX = "fsdp_plugin::"


def _traced(what: str):
    """Wrap a handle method in ``record_function("fsdp_plugin::<what>::<label>")`` while profiling."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if not _profiler_enabled():
                return fn(self, *args, **kwargs)
            with torch.profiler.record_function(f"{PREFIX}{what}::{self.label}"):
                return fn(self, *args, **kwargs)
        return wrapper
    return decorate
