"""``fsdp-plugin`` command line: ``inspect CKPT``, ``verify CKPT``, ``consolidate CKPT OUT [--format lightning]``,
``export CKPT OUT --format hf|dcp|lightning`` (``dcp``: a torch distributed-checkpoint directory).

CKPT is any layout fsdp_plugin writes (see :mod:`fsdp_plugin.checkpoint.format.layouts`): an ``fp.save_checkpoint`` or
Lightning directory, an accelerate ``save_state`` directory, a Trainer ``checkpoint-<n>``; ``inspect`` also
describes the ones it does not read (DCP, a Lightning file) and names what reads them.

Needs no process group and no GPU. Progress goes to stderr (a bar on a terminal, whole lines in a log); results
to stdout. Exit status: 0 ok, 1 a checkpoint problem (message on stderr), 2 bad usage, 141 the reader of stdout
went away (``| head``), as a tool killed by SIGPIPE reports it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ._progress import Progress
from .checkpoint.errors import CheckpointError


def _inspect(args) -> int:
    from .checkpoint.tools import inspect_checkpoint

    foreign = _foreign_layout(args.ckpt)
    if foreign is not None:  # recognised, but not ours to read: say what it is and what reads it
        print(json.dumps(foreign, indent=2) if args.json else f"{foreign['summary']}\n{foreign['reads']}")
        return 0
    info = inspect_checkpoint(args.ckpt)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    if info["layout"]["kind"] != "fsdp_plugin":
        print(f"{info['layout']['summary']}; shown: {info['path']}")
    print(f"checkpoint {info['path']}  (uuid {info['uuid']})")
    print(f"saved by world size {info['world_size']}, sharding {json.dumps(info['sharding'])}")
    print(f"{info['num_params']} parameters, {info['num_elements']:,} elements, "
          f"{info['bytes_on_disk']:,} bytes on disk in {len(info['files'])} files")
    for name, p in info["params"].items():
        desc = f"alias of {p['alias_of']}" if "alias_of" in p else f"{p['dtype']:5} {p['shape']}"
        frozen = "" if p.get("requires_grad", True) or "alias_of" in p else "  (frozen)"
        print(f"  {name}: {desc}{frozen}")
    for name, b in info["buffers"].items():
        print(f"  {name}: {b['dtype']:5} {b['shape']}  (buffer)")
    for i, o in enumerate(info["optimizers"]):
        print(f"optimizer {i}: {o['class']}, {o['param_groups']} param groups, state {', '.join(o['state_keys'])}")
    print("extra: " + json.dumps(info["extra"].get("0"))[:2000])
    return 0


def _foreign_layout(path: str) -> dict | None:
    """The layout of ``path`` when it is a checkpoint someone else reads (DCP, a Lightning file, Trainer weights)."""
    from .checkpoint.format.layouts import detect

    layout = detect(path)
    if layout.checkpoints or layout.kind not in ("dcp", "lightning-file", "trainer"):
        return None
    return {"kind": layout.kind, "path": layout.path, "summary": layout.summary, "reads": layout.reads}


def _verify(args) -> int:
    from .checkpoint.tools import verify_checkpoint

    problems = verify_checkpoint(args.ckpt, None if args.quiet else Progress("verify"))
    for p in problems:
        print(p, file=sys.stderr)
    print(f"{args.ckpt}: {'OK' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


def _consolidate(args) -> int:
    from .checkpoint.consolidate import consolidate

    if args.format == "lightning":
        from fsdp_plugin.integrations.lightning.checkpoint.convert import consolidate_lightning

        print(f"wrote {consolidate_lightning(args.ckpt, args.out)} (Lightning format: "
              "MyModule.load_from_checkpoint(path) reads it)")
        return 0
    names = consolidate(args.ckpt, args.out, args.max_shard_size, None if args.quiet else Progress("consolidate"),
                        keep_tied=not args.drop_tied)
    print(f"wrote {len(names)} file(s) to {args.out}")
    return 0


def _export(args) -> int:
    if args.format != "dcp":
        return _consolidate(args)
    from .checkpoint.dcp import export_dcp

    print(f"wrote {export_dcp(args.ckpt, args.out)} (torch DCP: torch.distributed.checkpoint.load reads it "
          "into an FSDP2 model and its optimizer, keys model.* and optimizer.*)")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-plugin", description="fsdp_plugin checkpoint tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("inspect", help="parameters, dtypes, world size and strategy at save, bytes, extra")
    p.add_argument("ckpt")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(fn=_inspect)
    p = sub.add_parser("verify", help="check sizes, headers and every CRC32 block")
    p.add_argument("ckpt")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=_verify)
    p = sub.add_parser("consolidate", help="export to Hugging Face safetensors (+ index), bounded memory; or, with "
                                           "--format lightning, to one Lightning checkpoint file")
    p.add_argument("ckpt")
    p.add_argument("out", help="output directory (hf) or file, e.g. model.ckpt (lightning)")
    p.add_argument("--format", choices=("hf", "lightning"), default="hf",
                   help="hf (default): safetensors + index; lightning: one file that "
                        "LightningModule.load_from_checkpoint reads (weights + Lightning state, full model in memory)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--drop-tied", action="store_true",
                   help="write tied parameters once, under their first name (HF hub convention); by default "
                        "they are written under every name so a strict load_state_dict works")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=_consolidate)
    p = sub.add_parser("export", help="leave fsdp_plugin: the checkpoint as torch DCP (dcp), HF safetensors (hf) "
                                      "or one Lightning file (lightning)")
    p.add_argument("ckpt")
    p.add_argument("out", help="output directory (dcp, hf) or file (lightning); must not exist for dcp")
    p.add_argument("--format", choices=("dcp", "hf", "lightning"), required=True)
    p.add_argument("--max-shard-size", default="5GB", help="hf: largest output file (default 5GB)")
    p.add_argument("--drop-tied", action="store_true", help="hf: write tied parameters once")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=_export)
    from .planner.cli import add_parser as _add_plan
    _add_plan(sub)   # ``fsdp-plugin plan``: lives in fsdp_plugin/plan/cli.py
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    # ``fsdp-plugin inspect CKPT | head`` closes our stdout early: that is the reader's choice, not a failure
    # worth a traceback. Point stdout at /dev/null so the interpreter's final flush does not raise again.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141


if __name__ == "__main__":
    sys.exit(main())
