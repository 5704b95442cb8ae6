"""torch distributed-checkpoint (DCP) directories in and out, without torch's planner or pickle loading.

The one place of fsdp_plugin that knows DCP's on-disk format (see ``shared/research/dcp-format.md``):

* :func:`is_dcp_dir`: a directory DCP's ``FileSystemWriter`` wrote (it has ``.metadata``).
* :func:`load_dcp`: read one into a sharded model and its optimizers at any world size, each rank reading
  only its byte ranges (``metadata``: allow-listed ``.metadata``; ``items``: ``.distcp`` items;
  ``reading``: ranged reads; ``tree``: which entries are the model and optimizers; ``load``).
* :func:`export_dcp`: write one of our checkpoints as a DCP directory that ``dcp.load`` reads (``export``).
"""
from __future__ import annotations

import os

from .export import export_dcp
from .load import load_dcp
from .metadata import METADATA_FILE


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


__all__ = ["export_dcp", "is_dcp_dir", "load_dcp"]
