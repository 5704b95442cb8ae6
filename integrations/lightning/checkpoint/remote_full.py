"""``state_dict_type="full"`` Lightning files at an fsspec URL (``s3://bucket/run/last.ckpt``).

The file is Lightning's own torch archive, the same bytes as on local disk (``load_from_checkpoint("s3://...")``
reads it through Lightning's fsspec loader). An object store cannot take every rank's ``pwrite`` into one object,
so rank 0 builds the archive in a local temporary directory (:func:`.torch_file.write_sharded`: ranks that do not
see that directory send it their bytes), then uploads it as one object: a single PUT or a multipart upload, which
the store makes visible whole at completion (an interrupted upload leaves the previous object, never half a
file). Loading downloads the object to a local temporary file on every rank, then reads it without pickle.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fsdp_plugin.checkpoint import _comm, storage
from fsdp_plugin.checkpoint.errors import CheckpointNotFoundError

#: Bytes per read of the local archive while uploading (a multiple of the upload part size's divisor).


def save(url: str, write_local: Callable[[Path], None]) -> None:
    """Collective: ``write_local(local_path)`` (collective, rank 0's path is the one written), then rank 0 uploads
    the file to ``url``; a failure on rank 0 raises on every rank."""
    url = storage.resolve(url, "FSDPPluginStrategy(state_dict_type='full') save_checkpoint")
    with tempfile.TemporaryDirectory(prefix="fsdp_plugin_full_") as d:
        local = Path(d) / "full.ckpt"
        write_local(local)
        err = None
        if _comm.rank() == 0:
            try:
                _upload(local, url)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank
                err = e
        _comm.raise_if_any_failed(err, "uploading the Lightning file")


def _upload(local: Path, url: str) -> None:
    storage.storage_for(url).put_file(str(local), url)     # one object, retried (the Trainer's uploads too)


def exists(url: str) -> bool:
    """Whether ``url`` is an object (a ``full`` file), not a prefix."""
    url = storage.resolve(url, "FSDPPluginStrategy load_checkpoint")
    return storage.storage_for(url).size(url) is not None


@contextmanager
def local_copy(url: str) -> Iterator[Path]:
    """The object at ``url`` downloaded to a local temporary file (removed on exit)."""
    url = storage.resolve(url, "FSDPPluginStrategy load_checkpoint")
    st = storage.storage_for(url)
    if st.size(url) is None:
        raise CheckpointNotFoundError(f"{url}: no such object (no 'full' checkpoint file there)")
    fd, name = tempfile.mkstemp(prefix="fsdp_plugin_full_", suffix=".ckpt")
    os.close(fd)
    try:
        st.get_file(url, name)
        yield Path(name)
    finally:
        os.unlink(name)


def is_url(path: Any) -> bool:
    return isinstance(path, str) and storage.is_url(path)
