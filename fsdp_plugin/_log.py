"""Standard logging for the engine: logger ``fsdp_plugin``, silent unless ``FSDP_PLUGIN_LOG=INFO|DEBUG``.

INFO: the unit table when a model is sharded. DEBUG: memory at each phase of every step (forward start/end,
end of backward). `memory_report(model)` returns the unit table as text.
"""
from __future__ import annotations

import logging
import os

import torch
from torch import nn

logger = logging.getLogger("fsdp_plugin")
logger.addHandler(logging.NullHandler())


def configure_from_env() -> None:
    """Honour ``FSDP_PLUGIN_LOG`` (a logging level name) once, at import; no-op when unset."""
    level = os.environ.get("FSDP_PLUGIN_LOG", "").strip().upper()
    if not level or not hasattr(logging, level):
        return
    if not any(getattr(h, "_fsdp_plugin", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s %(levelname)s] %(message)s"))
        handler._fsdp_plugin = True
        logger.addHandler(handler)
    logger.setLevel(getattr(logging, level))


def _units(model: nn.Module) -> list:
    root = getattr(model, "_fp_root", None)
    if root is None:
        from .errors import ShardingError
        raise ShardingError(f"{type(model).__name__} is not sharded: call fp.shard(model, ...) first")
    return root.units


def memory_report(model: nn.Module) -> str:
    """The unit table of a sharded model: per unit its parameters, shard bytes on this rank, bytes while
    unsharded (compute dtype), whether it reshards after forward (the engine's one table,
    ``RootState.reshard_table``: "kept" marks the last unit of the recorded forward order, which the default
    policy keeps to its backward, known once the first forward recorded the order), dtypes, and the strategy."""
    root = model._fp_root if getattr(model, "_fp_root", None) is not None else None
    units = _units(model)
    strategy, mesh = root.config.sharding_strategy, root.mesh
    lines = [f"fsdp_plugin: {len(units)} units, {strategy}, world {mesh.world_size} "
             f"(shard {mesh.shard_size} x replicate {mesh.replicate_size})",
             f"{'unit':<32}{'params':>14}{'shard bytes':>14}{'unsharded':>14}{'reshard':>9}  dtype (compute)"]
    reshards = _reshard_column(root)
    tot = [0, 0, 0]
    for i, u in enumerate(units):
        hs = list(u.handles)
        row = [sum(h.total for h in hs), sum(h.chunk * h.dtype.itemsize for h in hs),
               sum(h.padded * h.compute_dtype.itemsize for h in hs)]
        tot = [a + b for a, b in zip(tot, row)]
        dtypes = ", ".join(sorted({f"{_d(h.dtype)} ({_d(h.compute_dtype)})" for h in hs})) or "-"
        lines.append(f"{u.name[:31]:<32}{row[0]:>14,}{row[1]:>14,}{row[2]:>14,}{reshards[i]:>9}  {dtypes}")
    lines.append(f"{'total':<32}{tot[0]:>14,}{tot[1]:>14,}{tot[2]:>14,}")
    hpz = [h for u in units for h in u.handles if h.secondary is not None]
    if hpz:      # ShardingConfig(reshard_after_forward=<int>): what each resharded unit keeps for its backward
        lines.append(f"hpZ: secondary shards over groups of {hpz[0].secondary.size} ranks, "
                     f"+{sum(h.padded * h.compute_dtype.itemsize // h.secondary.size for h in hpz):,} bytes "
                     "held between each unit's forward and its backward")
    return "\n".join(lines)


def _reshard_column(root) -> list[str]:
    return ["yes" if after else "kept" if u.reshard_policy else "no"
            for u, after in zip(root.units, root.reshard_table())]


def _d(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def on_sharded(model: nn.Module) -> None:
    """Called at the end of fp.shard: the unit table at INFO, phase-memory hooks at DEBUG."""
    if logger.isEnabledFor(logging.INFO):
        logger.info("\n%s", memory_report(model))
    if logger.isEnabledFor(logging.DEBUG):
        _install_phase_logging(model)


def _held_bytes(units) -> tuple[int, int]:
    """(units unsharded now, bytes of their full parameters) as the engine holds them."""
    n = b = 0
    for u in units:
        full = [h for h in u.handles if h.is_unsharded and not getattr(h, "_aliases_shard", False)]
        n += bool(full)
        b += sum(h.padded * h.compute_dtype.itemsize for h in full)
    return n, b


def _phase(model: nn.Module, phase: str) -> None:
    units = _units(model)
    n, b = _held_bytes(units)
    msg = f"{phase}: {n}/{len(units)} units unsharded ({b:,} bytes)"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        msg += (f", cuda allocated {torch.cuda.memory_allocated():,}, "
                f"max {torch.cuda.max_memory_allocated():,}")
    logger.debug(msg)


def _install_phase_logging(model: nn.Module) -> None:
    from torch.autograd import Variable

    def end_of_backward():
        _phase(model, "backward end")

    def on_output_grad(grad):
        _phase(model, "backward start")
        Variable._execution_engine.queue_callback(end_of_backward)
        return grad

    def pre(module, args):
        _phase(model, "forward start")

    def post(module, args, output):
        _phase(model, "forward end")
        if torch.is_grad_enabled():
            t = next((t for t in torch.utils._pytree.tree_flatten(output)[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if t is not None:
                t.register_hook(on_output_grad)
        return output
    model.register_forward_pre_hook(pre, prepend=True)
    model.register_forward_hook(post)
