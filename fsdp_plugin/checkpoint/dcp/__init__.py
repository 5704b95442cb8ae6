"""torch distributed-checkpoint (DCP) directories in and out, without torch's planner or pickle loading.

The one place of fsdp_plugin that knows DCP's on-disk format (see ``shared/research/dcp-format.md``):

* :func:`is_dcp_dir`: a directory DCP's ``FileSystemWriter`` wrote (it has ``.metadata``).
* :func:`load_dcp`: read one into a sharded model and its optimizers at any world size, each rank reading
  only its byte ranges (``metadata``: allow-listed ``.metadata``; ``items``: ``.distcp`` items;
  ``reading``: ranged reads; ``tree``: which entries are the model and optimizers; ``load``).
* :func:`export_dcp`: write one of our checkpoints as a DCP directory that ``dcp.load`` reads (``export``).
"""
from __future__ import annotations

from ..format.layouts import is_dcp_dir
from .export import export_dcp
from .load import load_dcp

__all__ = ["export_dcp", "is_dcp_dir", "load_dcp"]
