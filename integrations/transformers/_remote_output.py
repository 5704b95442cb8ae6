"""``TrainingArguments(output_dir="s3://bucket/run")`` and ``resume_from_checkpoint="s3://..."`` (any fsspec URL).

The Trainer writes its own files (``trainer_state.json``, RNG states, config, training arguments) with
``os.makedirs``/``open`` and finds checkpoints with local listings, so it keeps working on a local staging
directory, one per process (``tempfile``), which *mirrors* the URL:

* the sharded state (``fsdp_plugin_state``: model, optimizer, scheduler) is written by every rank straight to
  ``<url>/checkpoint-<step>/fsdp_plugin_state`` (``fp.save_checkpoint``: each rank its own objects, the
  manifest last); nothing of it is staged;
* after each checkpoint, every process uploads the files it wrote into its staging copy of the folder (rank 0:
  the Trainer's files; every rank: its RNG state), then rank 0 deletes the remote ``checkpoint-*`` folders the
  Trainer rotated away locally (``save_total_limit``), each one's sharded-state manifest first. Both happen after
  the new checkpoint is complete, so the previous one stays loadable until then;
* resuming from a URL (or ``resume_from_checkpoint=True`` with a URL ``output_dir``: the highest step whose
  sharded state is published) downloads the folder without its sharded state into the staging directory, which
  the Trainer then reads; the sharded load reads the bucket (ranged reads, any process count).

:func:`url_of` maps a staging path back to its URL (``_checkpoint.state_dir`` uses it).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from typing import Any

from fsdp_plugin.checkpoint import _comm, storage
from fsdp_plugin.checkpoint.errors import CheckpointNotFoundError
from fsdp_plugin.checkpoint.storage import remote

STATE = "fsdp_plugin_state"
_CKPT = re.compile(r"^checkpoint-(\d+)$")
#: staging directory -> the URL it mirrors (staging directories are unique temporary paths)
_LINKS: dict[str, str] = {}


def url_of(path: str) -> str | None:
    """The URL that local ``path`` mirrors (None: not under a staging directory)."""
    path = os.path.abspath(path)
    for local, url in _LINKS.items():
        if path == local or path.startswith(local + os.sep):
            rel = os.path.relpath(path, local)
            return url if rel == "." else storage.join(url, *rel.split(os.sep))
    return None


def _stage(url: str) -> str:
    local = tempfile.mkdtemp(prefix="fsdp_plugin_trainer_")
    _LINKS[local] = url
    atexit.register(shutil.rmtree, local, True)
    return local


def staged(path: str) -> str:
    """A local folder to write ``path`` into: ``path`` itself unless it is a URL (then a fresh staging folder
    mirroring it; :func:`upload` sends what was written)."""
    if not storage.is_url(path):
        return path
    return _stage(storage.resolve(path, "Trainer.save_model output_dir"))


def upload(folder: str) -> None:
    """Collective: every process uploads what it wrote under staging ``folder`` (nothing when not staged)."""
    if url_of(folder) is None:
        return
    err = _attempt(lambda: _upload_folder(folder)) if os.path.isdir(folder) else None
    _comm.raise_if_any_failed(err, f"uploading {folder} to {url_of(folder)}")


def attach(trainer: Any) -> None:
    """A URL ``output_dir``: the Trainer writes to a staging directory that mirrors it (see the module doc)."""
    url = storage.resolve(trainer.args.output_dir, "Trainer with fsdp_plugin: TrainingArguments.output_dir")
    trainer._fp_output_url = url
    trainer.args.output_dir = _stage(url)


def after_checkpoint(trainer: Any, run_dir: str) -> None:
    """Collective, after the Trainer wrote ``run_dir/checkpoint-<step>``: upload, then mirror the rotation."""
    url = url_of(run_dir)
    if url is None:
        return
    folder = os.path.join(run_dir, f"checkpoint-{trainer.state.global_step}")
    upload(folder)
    uploaded = trainer.__dict__.setdefault("_fp_uploaded", set())
    uploaded.add(os.path.basename(folder))
    err = _attempt(lambda: _rotate(run_dir, url, uploaded)) if _comm.rank() == 0 else None
    _comm.raise_if_any_failed(err, "removing rotated Trainer checkpoints")


def _attempt(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - agreed on by every rank
        return e
    return None


def _upload_folder(folder: str) -> None:
    """Every file this process staged under ``folder`` goes to its URL (one object each, retried)."""
    st = storage.storage_for(url_of(folder))
    for root, _dirs, files in os.walk(folder):
        for name in files:
            local = os.path.join(root, name)
            target = url_of(local)
            st.put_file(local, target)


def _rotate(run_dir: str, url: str, uploaded: set) -> None:
    """Remove the remote folders this Trainer uploaded and then rotated away from rank 0's staging copy (never
    one it did not write: an earlier run's checkpoints under the same URL are not in the staging directory)."""
    st = storage.storage_for(url)
    for name in sorted(uploaded):
        if not os.path.isdir(os.path.join(run_dir, name)):
            storage.remove_checkpoint(storage.join(url, name, STATE))  # uncommit the state first
            st.remove_tree(storage.join(url, name))
            uploaded.discard(name)


def resume_path(trainer: Any, resume: Any) -> Any:
    """``resume_from_checkpoint`` for the stock ``train``: a URL (or True with a URL ``output_dir``) becomes a
    local staging copy of the folder (without its sharded state, read from the URL); anything else as given."""
    if resume is True and getattr(trainer, "_fp_output_url", None):
        resume = _last_checkpoint(trainer._fp_output_url)
    if not (isinstance(resume, str) and storage.is_url(resume)):
        return resume
    url = storage.resolve(resume, "Trainer resume_from_checkpoint")
    local = os.path.join(_stage(url.rsplit("/", 1)[0]), url.rsplit("/", 1)[1])
    _download_folder(url, local)
    return local


def _last_checkpoint(url: str) -> str:
    st = storage.storage_for(url)
    steps = sorted((int(m.group(1)) for m in map(_CKPT.match, st.listdir(url)) if m), reverse=True)
    for step in steps:
        ckpt = storage.join(url, f"checkpoint-{step}")
        if st.size(storage.join(ckpt, STATE, "manifest.json")) is not None:
            return ckpt
    raise CheckpointNotFoundError(f"{url}: no checkpoint-<step> folder with a published {STATE} "
                                  "(resume_from_checkpoint=True found nothing to resume from)")


def _download_folder(url: str, local: str) -> None:
    """Every object under ``url`` but the sharded state, to ``local`` (created fresh)."""
    st = storage.storage_for(url)
    shutil.rmtree(local, ignore_errors=True)
    os.makedirs(local)
    base = st._p(url).rstrip("/")
    found = remote.with_retries("list", url, lambda: st.fs.find(base))
    if not found:
        raise CheckpointNotFoundError(f"{url}: no such Trainer checkpoint folder (nothing is stored under it)")
    for key in found:
        rel = key[len(base) + 1:]
        if rel.split("/", 1)[0] == STATE:
            continue
        dest = os.path.join(local, *rel.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        st.get_file(storage.join(url, rel), dest)
