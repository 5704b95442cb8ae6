"""``save_pretrained`` to an object-store URL: Hugging Face's format is one set of shared files (not one per rank),
and an object store cannot take the ranks' ``pwrite``s into one object, so rank 0 gathers the model into a local
temporary directory (``gather=True``: one parameter at a time), then uploads every file, the index (or the single
``model.safetensors``) last, so a reader that finds the index finds every shard it names."""
from __future__ import annotations

import os
import shutil
import tempfile

from .. import _comm
from .hf_out import INDEX_NAME
from ..storage import join, storage_for

#: Bytes per write of an upload stream.


def save_pretrained_remote(save_local, model, url: str, **kwargs) -> None:
    """Collective: ``save_local(model, tmp, gather=True, **kwargs)`` into rank 0's temporary directory, then
    rank 0 uploads it to ``url``."""
    rank = _comm.rank()
    tmp = tempfile.mkdtemp(prefix="fsdp_plugin_hf_") if rank == 0 else None
    tmp = _comm.broadcast_bytes(tmp.encode() if tmp else None).decode()
    try:
        save_local(model, os.path.join(tmp, "out"), gather=True, **kwargs)
        err = None
        if rank == 0:
            try:
                _upload(os.path.join(tmp, "out"), url)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = e
        _comm.raise_if_any_failed(err)
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _upload(local: str, url: str) -> None:
    names = sorted(os.listdir(local))
    last = [n for n in names if n in (INDEX_NAME, "model.safetensors")]
    st = storage_for(url)
    for name in [n for n in names if n not in last] + last:
        st.put_file(os.path.join(local, name), join(url, name))

