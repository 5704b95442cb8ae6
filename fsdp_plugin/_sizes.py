"""The one parser of byte sizes written by people ("5GB", "2GiB", "1e9"): checkpoint shard sizes and the
planner's memory budgets read sizes the same way."""
from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
    """``"5GB"`` -> 5_000_000_000 (decimal, like the hub); ``"2GiB"`` binary; ``"1e9"``; numbers pass through."""
    if isinstance(size, (int, float)):
        return int(size)
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"invalid size {size!r}: use e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
