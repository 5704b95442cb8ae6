"""What a checkpoint path is, judged by its files alone: every layout fsdp_plugin and its integrations write.

The checkpoint package never imports the integrations, so their layouts are described here by the files
they leave (their writers are the reference; tests/test_layouts.py writes each layout through them):

    fsdp_plugin   manifest.json + rank<r>.<kind>.safetensors            fp.save_checkpoint
    lightning     the same, with Lightning's state in extra["lightning"]   strategy="fsdp_plugin", sharded
    accelerate    accelerator_state.json + model_<i>/ (fsdp_plugin dirs, optimizer inside) + rng_<r>.json
    trainer       trainer_state.json + fsdp_plugin_state/ (an fsdp_plugin dir)   transformers Trainer checkpoint-<n>/
    dcp           .metadata + *.distcp                                     torch.distributed.checkpoint
    lightning file    one torch zip file                                   Lightning state_dict_type="full"

:func:`detect` describes a path; :func:`checkpoint_dir` is what every reader (``fp.load_checkpoint``, the
``fsdp-plugin`` tools) calls to get the one fsdp_plugin checkpoint directory inside it. "Interrupted" is
said only with evidence: a ``<path>.tmp-<id>`` sibling, a ``manifest.json.tmp``, or rank files without a
manifest. Everything else that is not readable is described as what it is, with the command that reads it.
"""
from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass

from ..storage import is_url, join, storage_for
from . import manifest
from ..errors import CheckpointError, CheckpointStateError, IncompleteCheckpointError

_RANK_FILE = re.compile(r"^rank\d{5,}\.(model|optim|extra)\.safetensors$")
_OUR_TOOLS = "fp.load_checkpoint and fsdp-plugin inspect/verify/consolidate read it"
#: what reads a DCP directory
DCP_READER = ("fp.load_checkpoint (and our Lightning strategy, Accelerator and Trainer) reads it into a sharded "
              "model; torch.distributed.checkpoint.load too")

#: Name of DCP's metadata file.
METADATA_FILE = ".metadata"


def is_dcp_dir(path) -> bool:
    """Whether ``path`` is a directory written by ``torch.distributed.checkpoint``: it holds ``.metadata``,
    or ``.distcp`` data files and no ``manifest.json`` (an interrupted DCP save, reported as such on load)."""
    path = os.fspath(path)
    if is_url(path) or not os.path.isdir(path):  # DCP on an object store: torch's FsspecReader reads it
        return False
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return True
    names = os.listdir(path)
    return "manifest.json" not in names and any(n.endswith(".distcp") for n in names)


@dataclass(frozen=True)
class Layout:
    """``kind``: one of fsdp_plugin, lightning, accelerate, trainer, dcp, lightning-file, interrupted, missing,
    unknown. ``checkpoints``: the fsdp_plugin checkpoint directories it holds (the path itself for ours).
    ``summary``: what it is, one line. ``reads``: which command or function reads it."""

    kind: str
    path: str
    summary: str
    reads: str
    checkpoints: tuple[str, ...] = ()


def detect(path) -> Layout:
    """Describe ``path`` from its files (reads at most small JSON files: manifests, trainer/accelerate state)."""
    path = os.fspath(path)
    if is_url(path):  # an object store: only our own layouts are described there
        names = set(storage_for(path).listdir(path))
        for probe in (_ours,):
            found = probe(path, names)
            if found is not None:
                return found
        sub = [join(path, n) for n in sorted(names) if storage_for(path).size(join(path, n, manifest.NAME))]
        if sub:
            return Layout("unknown", path, f"{path} holds {_plural(len(sub), 'checkpoint')}", _OUR_TOOLS, tuple(sub))
        return Layout("missing" if not names else "unknown", path,
                      f"{path}: nothing published there" if not names else f"{path} holds no manifest.json", "")
    if not os.path.exists(path):
        return Layout("missing", path, f"{path} does not exist", "")
    if not os.path.isdir(path):
        return _file(path)
    names = set(os.listdir(path))
    for probe in (_ours, _accelerate, _trainer, _dcp, _trainer_output, _interrupted):
        found = probe(path, names)
        if found is not None:
            return found
    shown = ", ".join(sorted(names)[:6]) + (", ..." if len(names) > 6 else "")
    held = f"holds {_plural(len(names), 'entry')} ({shown})" if names else "is empty"
    return Layout("unknown", path, f"{path} {held}", "")


def checkpoint_dir(path) -> str:
    """The one fsdp_plugin checkpoint directory of ``path`` (itself, ``model_0/``, ``fsdp_plugin_state/``).

    Raises :class:`IncompleteCheckpointError` only with evidence of an interrupted save; otherwise a
    :class:`CheckpointStateError` saying what ``path`` is and what reads it (or, for a missing path, the
    manifest module's message, which points to a ``.old-`` sibling left by an interrupted replace).
    """
    if is_url(path):  # an object store: ours, or accelerate's / a Trainer's folder around ours (no probing)
        st = storage_for(path)
        for sub in ((), ("model_0",), ("fsdp_plugin_state",)):
            if st.size(join(path, *sub, manifest.NAME)) is not None:
                return join(path, *sub)
        manifest.read(path)  # raises: nothing published at this URL
    if os.path.isfile(os.path.join(path, manifest.NAME)):
        return os.fspath(path)  # ours (or Lightning's): the reader validates the manifest, once
    layout = detect(path)
    if len(layout.checkpoints) == 1:
        return layout.checkpoints[0]
    if layout.kind == "missing":
        manifest.read(os.fspath(path))  # raises, with the .old- sibling hint
    raise not_readable(layout)


def not_readable(layout: Layout) -> CheckpointError:
    """The error for a layout that holds no single fsdp_plugin checkpoint directory."""
    if layout.kind == "interrupted":
        return IncompleteCheckpointError(f"{layout.summary}. Load the previous checkpoint.")
    if len(layout.checkpoints) > 1:
        return CheckpointStateError(f"{layout.summary}: name one of {', '.join(layout.checkpoints)}")
    reads = f"; {layout.reads}" if layout.reads else ""
    return CheckpointStateError(f"{layout.summary}: not an fsdp_plugin checkpoint directory{reads}. fsdp_plugin "
                                "reads the directories of fp.save_checkpoint, Lightning, accelerate save_state and "
                                "Trainer checkpoint-<n>")


# -- probes: each returns a Layout, or None when the directory is not of its kind ----------------------------
def _ours(path: str, names: set) -> Layout | None:
    if manifest.NAME not in names:
        return None
    doc = manifest.read(path)
    extra = doc.get("extra", {}).get("0")
    extra = extra if isinstance(extra, dict) else {}  # rank 0's extra: where trainers keep their step
    opts = _plural(len(doc.get("optimizers", [])), "optimizer")
    lightning = extra.get("lightning")
    if isinstance(lightning, dict):
        return Layout("lightning", path, f"Lightning checkpoint: step {lightning.get('global_step')}, epoch "
                                         f"{lightning.get('epoch')}, {opts}, saved by world size {doc['world_size']}",
                      "Trainer.fit(ckpt_path=...) with strategy='fsdp_plugin'; " + _OUR_TOOLS, (path,))
    n = sum("alias_of" not in e for e in doc["params"].values())
    at = f", step {extra['step']}" if isinstance(extra.get("step"), int) else ""
    return Layout("fsdp_plugin", path, f"fsdp_plugin checkpoint: {n} parameters, {opts}, saved by world size "
                                       f"{doc['world_size']}{at}", _OUR_TOOLS, (path,))


def _accelerate(path: str, names: set) -> Layout | None:
    if "accelerator_state.json" not in names:
        return None
    models = sorted((n for n in names if re.fullmatch(r"model_\d+", n)), key=lambda n: int(n[6:]))
    dirs = tuple(os.path.join(path, m) for m in models if os.path.isfile(os.path.join(path, m, manifest.NAME)))
    opts = sum(len(manifest.read(d).get("optimizers", [])) for d in dirs)
    step = _json(os.path.join(path, "accelerator_state.json")).get("tree", {}).get("step")
    full = sum(bool(re.fullmatch(r"full_model_\d+", n)) for n in names)
    hf = f", full weights in {_plural(full, 'full_model_<i>/ folder')}" if full else ""
    missing = f" ({len(models) - len(dirs)} without manifest.json)" if len(dirs) < len(models) else ""
    summary = (f"accelerate state: {_plural(len(models), 'model')}{missing}, {_plural(opts, 'optimizer')}, "
               f"accelerator.step {step}{hf}")
    return Layout("accelerate", path, summary, "Accelerator.load_state(path); " + _OUR_TOOLS + " (model_<i>/)", dirs)


def _trainer(path: str, names: set) -> Layout | None:
    if "trainer_state.json" not in names:
        return None
    step = _json(os.path.join(path, "trainer_state.json")).get("global_step")
    state = os.path.join(path, "fsdp_plugin_state")
    if os.path.isfile(os.path.join(state, manifest.NAME)):
        opts = _plural(len(manifest.read(state).get("optimizers", [])), "optimizer")
        return Layout("trainer", path, f"Trainer checkpoint: step {step}, model + {opts} in fsdp_plugin_state/",
                      "Trainer.train(resume_from_checkpoint=path) after `import fsdp_plugin.integrations."
                      "transformers`; " + _OUR_TOOLS + " (fsdp_plugin_state/)", (state,))
    weights = sorted(n for n in names if n.endswith(".safetensors") or n.endswith(".safetensors.index.json"))
    what = f"Hugging Face weights ({', '.join(weights)})" if weights else "no fsdp_plugin_state/"
    return Layout("trainer", path, f"Trainer checkpoint: step {step}, {what}",
                  "from_pretrained(path) reads its weights" if weights else "")


def _dcp(path: str, names: set) -> Layout | None:
    shards = [n for n in names if n.endswith(".distcp")]
    if not is_dcp_dir(path):
        subs = [n for n in sorted(names) if os.path.isfile(os.path.join(path, n, ".metadata"))]
        if not subs:
            return None
        return Layout("dcp", path, f"a directory of torch distributed checkpoints (DCP: {', '.join(subs)}/; "
                                   "stock torch FSDP, accelerate or Trainer)", DCP_READER)
    size = sum(os.path.getsize(os.path.join(path, n)) for n in shards)
    return Layout("dcp", path, f"torch distributed checkpoint (DCP): .metadata + {_plural(len(shards), '.distcp file')}, "
                               f"{size:,} bytes", DCP_READER)


def _trainer_output(path: str, names: set) -> Layout | None:
    steps = sorted((n for n in names if re.fullmatch(r"checkpoint[-_]\d+", n)), key=lambda n: int(n[11:]))
    if not steps:
        return None
    last = os.path.join(path, steps[-1])
    return Layout("trainer-output", path, f"{path} holds {_plural(len(steps), 'checkpoint folder')} "
                                         f"({', '.join(steps[-3:])}): give one of them, e.g. {last}", "")


def _interrupted(path: str, names: set) -> Layout | None:
    parent, base = os.path.split(os.path.abspath(path))
    leftover = sorted(n for n in os.listdir(parent) if re.fullmatch(re.escape(base) + r"\.tmp-[0-9a-f]{32}", n))
    ranks = sorted(n for n in names if _RANK_FILE.match(n))
    if leftover:
        why = f"{os.path.join(parent, leftover[-1])} is left by a save that did not finish"
    elif manifest.NAME + ".tmp" in names:
        why = "it holds manifest.json.tmp, the manifest of a save that did not finish"
    elif ranks:
        why = f"it holds {_plural(len(ranks), 'rank file')} but no manifest.json, which a save writes last"
    else:
        return None
    return Layout("interrupted", path, f"{path} is an interrupted fsdp_plugin checkpoint save: {why}", "")


def _file(path: str) -> Layout:
    if zipfile.is_zipfile(path):
        return Layout("lightning-file", path, f"{path} is one file (a torch zip archive, e.g. Lightning's "
                                              "state_dict_type='full' or `fsdp-plugin consolidate --format lightning`)",
                      "MyModule.load_from_checkpoint(path), torch.load(path, weights_only=True) or, with "
                      "strategy='fsdp_plugin', Trainer.fit(ckpt_path=path) read it")
    return Layout("unknown", path, f"{path} is a file, not a checkpoint directory", "")


def _json(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _plural(n: int, noun: str) -> str:
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun[:-1]}ies" if noun.endswith("y") else f"{n} {noun}s"
