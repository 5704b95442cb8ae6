"""Which directories are torch DCP checkpoints (imports nothing of the package: the loaders' dispatch uses it)."""
from __future__ import annotations

import os

#: Name of DCP's metadata file.
METADATA_FILE = ".metadata"


def is_dcp_dir(path) -> bool:
    """Whether ``path`` is a directory written by ``torch.distributed.checkpoint``: it holds ``.metadata``,
    or ``.distcp`` data files and no ``manifest.json`` (an interrupted DCP save, reported as such on load)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return True
    names = os.listdir(path)
    return "manifest.json" not in names and any(n.endswith(".distcp") for n in names)
