"""``fsdp-plugin plan MODEL``: memory per rank, wire bytes and step time before the job starts.

MODEL is ``pkg.module:factory`` (a callable returning the model, built on the meta device) or a Hugging
Face ``config.json`` / directory holding one. Exit status 0, or 2 for a bad model/option (message on stderr).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys

STRATEGIES = ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard")


def add_parser(sub) -> None:
    """Register the ``plan`` subcommand on the ``fsdp-plugin`` parser."""
    from ..config import CP_ATTENTION
    from ._optim import OPTIMIZERS
    from ._time import HARDWARE

    p = sub.add_parser("plan", help="predict memory per rank and step time (nothing allocated)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="pkg.module:factory, or a Hugging Face config.json / directory")
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 4, 8], help="world sizes (default 1 2 4 8)")
    p.add_argument("--strategy", choices=STRATEGIES, default="full_shard")
    p.add_argument("--wrap", help="comma-separated unit classes (names of the model's module classes, or "
                                  "pkg.module:Class); default: the repeated blocks / HF _no_split_modules")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--batch", type=int, default=1, help="sequences per rank per micro-batch (default 1)")
    p.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    p.add_argument("--inputs", help="pkg.module:fn returning one micro-batch per rank (overrides --batch/--seq)")
    p.add_argument("--mixed-precision", choices=("bf16", "fp16"))
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute every unit in backward")
    p.add_argument("--ac-every", type=int, default=1, metavar="K",
                   help="with --activation-checkpointing: only every K-th unit (default 1)")
    p.add_argument("--ac-selective", action="store_true", help="with --activation-checkpointing: torch's "
                   "selective checkpointing (keep matmul/attention outputs, recompute the rest)")
    p.add_argument("--cpu-offload", action="store_true")
    p.add_argument("--no-backward-prefetch", action="store_true")
    p.add_argument("--forward-prefetch", action="store_true")
    p.add_argument("--no-limit-all-gathers", action="store_true", help="prefetch two units ahead, not one")
    p.add_argument("--device", choices=("cpu", "cuda"), help="target device (default: cuda if present)")
    time_src = p.add_mutually_exclusive_group()
    time_src.add_argument("--calibrate", action="store_true",
                          help="measure compute and (under torchrun) collective throughput here first")
    time_src.add_argument("--hardware", choices=sorted(HARDWARE), help="named GPU + network throughputs")
    p.add_argument("--fit", metavar="MEMORY", help="recommend the smallest world size / strategy / activation "
                                                   "checkpointing whose peak fits, e.g. 80GB")
    p.add_argument("--max-world", type=int, default=1024, help="largest world size --fit tries (default 1024)")
    p.add_argument("--link-latency-us", type=float, help="one small-message hop in microseconds (e.g. 30): also "
                                                         "print the latency floor (collectives x ring steps x latency), "
                                                         "blocking waits and store traffic per step")
    p.add_argument("--tp-size", type=int, default=1, metavar="TP", help="tensor-parallel degree: each world size "
                   "is dp x TP ranks; the model's plan from --tp-plan (default: a transformers model's own tp_plan)")
    p.add_argument("--tp-plan", metavar="PKG.MODULE:ATTR", help="with --tp-size: the {module: style} dict you give "
                   "parallelize_module (or a function returning it)")
    p.add_argument("--context-parallel", type=int, default=1, metavar="C", help="split every sequence over C "
                   "ranks (a transformers model): activations of S/C tokens per rank, the attention's traffic")
    p.add_argument("--context-parallel-attention", choices=CP_ATTENTION, default="allgather")
    p.add_argument("--expert-parallel", type=int, metavar="E", help="experts of each MoE layer split over E "
                   "ranks (dp2ep): all-to-all bytes, the experts' smaller gathers, the receive-buffer peak; with "
                   "--tp-size the experts stay whole on every TP rank (the model's tp_plan without the experts' "
                   "entries)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ._capture import capture
    from ._fit import fit
    from .api import plan
    from .errors import PlanError

    try:
        module = capture(args.model)
        kwargs = dict(auto_wrap_policy=_wrap(args.wrap, module), optimizer=args.optimizer,
                      inputs=_import(args.inputs) if args.inputs else None, batch_size=args.batch, seq_len=args.seq,
                      mixed_precision=args.mixed_precision, cpu_offload=args.cpu_offload,
                      backward_prefetch=not args.no_backward_prefetch, forward_prefetch=args.forward_prefetch,
                      limit_all_gathers=not args.no_limit_all_gathers, device=args.device,
                      calibration="calibrate" if args.calibrate else args.hardware)
        if args.context_parallel != 1:      # issue 54
            kwargs.update(context_parallel=args.context_parallel,
                          context_parallel_attention=args.context_parallel_attention)
        if args.expert_parallel not in (None, 1):     # issue 55
            kwargs["expert_parallel"] = args.expert_parallel
        if args.link_latency_us is not None:
            kwargs["link_latency_us"] = args.link_latency_us
        if args.tp_size != 1:      # issue 31: planned from the plain model and its TP plan
            if args.fit:
                raise PlanError("--fit with --tp-size is not supported: plan given --world sizes (multiples of TP)")
            tp_plan = _import(args.tp_plan) if args.tp_plan else "auto"
            kwargs.update(tp_size=args.tp_size, tp_plan=tp_plan() if callable(tp_plan) else tp_plan)
        if args.fit:
            result = fit(module, args.fit, max_world=args.max_world, **kwargs)
        else:
            result = plan(module, world_size=args.world, sharding_strategy=args.strategy,
                          activation_checkpointing=_checkpointing(args), **kwargs)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2, default=str) if args.json else result)
    return 0


def _checkpointing(args):
    """The --activation-checkpointing flags as a ShardingConfig value (None: off)."""
    from ..config import Checkpointing
    from ..errors import ConfigError
    from .errors import PlanError

    if not args.activation_checkpointing:
        if args.ac_every != 1 or args.ac_selective:
            raise PlanError("--ac-every / --ac-selective refine --activation-checkpointing: add it")
        return None
    try:
        return Checkpointing(every=args.ac_every, selective=args.ac_selective)
    except ConfigError as e:
        raise PlanError(str(e)) from e


def _import(spec: str):
    mod, _, attr = spec.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _wrap(text, module):
    """Class names of the model's own modules (or pkg.module:Class) -> the set fp.shard takes."""
    if not text:
        return None
    from .errors import PlanError

    by_name = {type(m).__name__: type(m) for m in module.modules()}
    out = set()
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if ":" in name:
            out.add(_import(name))
        elif name in by_name:
            out.add(by_name[name])
        else:
            raise PlanError(f"--wrap {name}: the model has no module class of that name; its classes are "
                            f"{', '.join(sorted(by_name))}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-plugin-plan")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_parser(sub)
    args = parser.parse_args(["plan", *(sys.argv[1:] if argv is None else argv)])
    return args.fn(args)
