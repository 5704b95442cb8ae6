"""The on-demand some-ranks schedule: a default-chosen modality encoder (``_build/some_ranks_default.py``) is
gathered only on steps where some rank's batch holds that modality.

The decision is taken at the root's pre-forward, which every rank reaches once per step, before any encoder
can run: each rank looks at its own inputs for a non-empty tensor under a transformers modality input name
(``pixel_values``, ``input_features``...; by keyword, by position in the root's ``forward`` signature, or as a
key of a mapping inside them: a Lightning batch dict), and one 1-byte MAX all-reduce on the gloo control group
(CPU: it never waits for a GPU) makes the answer global. Then:

* no rank holds the modality: the encoder is not gathered, not held, not reduced (no gradient anywhere, so
  ``.grad`` stays None as in one process); the step pays one control message;
* some rank does: the held schedule (``RootState.after_unshard_in_forward``), except that a rank that did not
  run the encoder frees it when its backward starts (``RootState._release_unused``: no forward of this step
  can follow, and recomputation re-runs only what ran; not earlier, since a second forward before that
  backward must find it gathered on every rank), so only the ranks that ran it hold it through backward.

An encoder that runs on a step the decision said no (its input under a name we do not know) raises
`CollectiveError` on that rank before any collective, naming the fix; the others then fail at their deadline.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._comm import collectives as comm
from .._groups.mesh import control_group
from ..errors import CollectiveError

# transformers' names for the inputs that feed a vision or audio encoder (LLaVA, Qwen2-VL, Gemma 3, Idefics,
# Whisper-style audio LMs, Qwen2-Audio...)
MODALITY_INPUTS = frozenset({"pixel_values", "pixel_values_videos", "pixel_values_images", "input_features",
                             "audio_values", "input_values", "image_embeds", "video_embeds"})


def _non_empty(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() > 0
    if isinstance(value, (list, tuple)):
        return any(_non_empty(v) for v in value)
    return False


_SCAN_ITEMS = 16      # of a list/tuple argument: (batch, batch_idx), a few dicts; never a long list of ids


def _holds(value: Any, depth: int = 0) -> bool:
    """A mapping (batch dict, BatchFeature) inside ``value`` has a non-empty tensor under a modality name."""
    if depth > 4:
        return False
    if isinstance(value, Mapping):
        return any(_non_empty(v) if k in MODALITY_INPUTS else _holds(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, depth + 1) for v in value[:_SCAN_ITEMS])
    return False


def positional_names(module: torch.nn.Module) -> list[str]:
    """The names of ``module.forward``'s positional parameters, in order ([] when it takes ``*args`` only)."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def holds_modality(args: tuple, kwargs: dict, names: list[str]) -> bool:
    """This rank's root inputs feed a modality encoder: a non-empty tensor under a modality name."""
    named = dict(zip(names, args))
    named.update(kwargs)
    if any(k in MODALITY_INPUTS and _non_empty(v) for k, v in named.items()):
        return True
    return _holds(list(args)) or _holds(kwargs)


def any_rank_holds(local: bool, timeout_s: float) -> bool:
    """One 1-byte MAX all-reduce on the control group: does any rank's batch hold the modality this step?"""
    flag = torch.tensor([1 if local else 0], dtype=torch.uint8)
    comm.all_reduce(flag, control_group(), op=dist.ReduceOp.MAX, kind="control",
                    what="some-ranks encoder decision (does any rank hold images/audio this step?)",
                    timeout_s=timeout_s)
    return bool(flag.item())


def not_gathered_error(unit) -> CollectiveError:
    return CollectiveError(
        f"{unit.fqn!r} ({type(unit.module).__name__}) ran on a step where no rank's inputs held a modality tensor "
        f"under a name the default schedule knows ({', '.join(sorted(MODALITY_INPUTS))}), so it was not "
        "gathered and running it alone would hang the other ranks. Pass the encoder's input to the model under "
        f"its transformers name, or declare ShardingConfig(some_ranks_modules={{{type(unit.module).__name__!r}}}) "
        "(held every step: no decision). Call fp.reset(model) on every rank before the next step.")
