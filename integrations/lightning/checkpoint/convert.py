"""``fsdp-plugin consolidate CKPT OUT.ckpt --format lightning``: a sharded Lightning checkpoint directory
to one file that Lightning loads like its own (``MyModule.load_from_checkpoint``, ``weights_only=True``).

Needs no process group, no GPU and no Lightning import. The output holds the full weights and Lightning's
state (hyper-parameters, loops, callbacks, schedulers); like ``state_dict_type="full"``, not the
optimizers' per-parameter state. Memory: streamed, O(one CRC block): the archive is laid out first and each
rank file's bytes are copied into it block by block (``torch_file.write_streamed``).
"""
from __future__ import annotations

import os
from pathlib import Path

from fsdp_plugin.checkpoint.storage import require_local
from fsdp_plugin.checkpoint.consolidate import read_extra, state_entries, stream_state
from fsdp_plugin.checkpoint.errors import CheckpointError
from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt
from fsdp_plugin.integrations.lightning.checkpoint import torch_file as torch_file

__all__ = ["consolidate_lightning"]


def consolidate_lightning(checkpoint_dir: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the Lightning-format file ``out`` from the sharded directory ``checkpoint_dir``; return ``out``.

    Raises :class:`~fsdp_plugin.checkpoint.CheckpointError` when the directory was not saved by
    ``FSDPPluginStrategy`` (no Lightning state) or ``out`` is a directory.
    """
    out = Path(require_local(out, "consolidate --format lightning (its output)"))  # the input may be a URL
    if out.is_dir():
        raise CheckpointError(f"{out} is a directory: --format lightning writes one file, e.g. {out / 'model.ckpt'}")
    extra = read_extra(checkpoint_dir)
    if not isinstance(extra, dict) or ckpt.EXTRA_KEY not in extra:
        raise CheckpointError(f"{checkpoint_dir} holds no Lightning state (it was not saved by FSDPPluginStrategy): "
                              "export its weights with `fsdp-plugin consolidate CKPT OUT` (Hugging Face format)")
    tree, tensors = extra[ckpt.EXTRA_KEY], extra.get(ckpt.EXTRA_TENSORS_KEY) or {}
    meta = ckpt.decode_state(tree, tensors)
    torch_file.write_streamed(out, state_entries(checkpoint_dir), meta,
                              {ckpt.FULL_META_KEY: ckpt.inline_tensors(tree, tensors)},
                              lambda target: stream_state(checkpoint_dir, target))
    return out
