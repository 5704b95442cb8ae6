"""Map Lightning precision flags to the engine's ``fp.MixedPrecision`` policy (no Lightning import here).

| flag          | sharded master | all-gather / compute | gradient reduce | autocast | loss scaler |
|---------------|----------------|----------------------|-----------------|----------|-------------|
| ``32-true``   | fp32           | fp32                 | fp32            | no       | no          |
| ``bf16-mixed``| fp32           | bf16                 | **fp32**        | bf16     | no          |
| ``16-mixed``  | fp32           | fp16                 | **fp32**        | fp16     | sharded (CUDA only) |
| ``bf16-true`` | bf16           | bf16                 | bf16            | no       | no          |

"fp32" masters hold for a model loaded in bf16 too: under ``*-mixed`` its trainable parameters get fp32 master
shards (``fp.MixedPrecision.master_dtype``); frozen parameters stay as loaded. Any other flag is refused with a
message listing these.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from fsdp_plugin.errors import ConfigError

SUPPORTED_FLAGS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


@dataclass(frozen=True)
class PrecisionSpec:
    """What one flag means: dtypes for the engine policy, autocast, module cast, and whether it needs a scaler."""

    flag: str
    param_dtype: torch.dtype | None  # all-gather/compute dtype given to fp.MixedPrecision (None: as stored)
    reduce_dtype: torch.dtype | None
    autocast_dtype: torch.dtype | None  # torch.autocast dtype for "*-mixed"
    module_dtype: torch.dtype | None  # "*-true": module cast before sharding (no fp32 master)
    scaler: bool = False

    def mixed_precision(self) -> Any:
        """The ``fp.MixedPrecision`` policy for this flag, or None for pure fp32."""
        if self.param_dtype is None and self.reduce_dtype is None:
            return None
        import dataclasses

        import fsdp_plugin as fp

        kwargs = {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype}
        if any(f.name == "cast_forward_inputs" for f in dataclasses.fields(fp.MixedPrecision)):
            kwargs["cast_forward_inputs"] = False  # autocast casts; targets and masks keep their dtype
        return fp.MixedPrecision(**kwargs)


_SPECS = {
    "32-true": PrecisionSpec("32-true", None, None, None, None),
    "bf16-mixed": PrecisionSpec("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16, None),
    "16-mixed": PrecisionSpec("16-mixed", torch.float16, torch.float32, torch.float16, None, scaler=True),
    "bf16-true": PrecisionSpec("bf16-true", None, None, None, torch.bfloat16),
}


def unsupported_message(flag: Any, source: str = "precision") -> str:
    """The error text for a flag (or plugin) we do not support."""
    return (
        f"fsdp_plugin's Lightning strategy does not support {source}={flag!r}. "
        f"Supported precision flags: {', '.join(repr(f) for f in SUPPORTED_FLAGS)} ('16-mixed' needs CUDA)."
    )


def precision_spec(flag: Any, device_type: str = "cpu") -> PrecisionSpec:
    """Resolve a Lightning precision flag into a :class:`PrecisionSpec`; refuse unsupported flags."""
    flag = _ALIASES.get(flag, flag)
    if flag not in _SPECS:
        raise ConfigError(unsupported_message(flag))
    if flag == "16-mixed" and device_type != "cuda":
        raise ConfigError("precision='16-mixed' needs CUDA (fp16 autocast with a loss scaler); on CPU use 'bf16-mixed'.")
    return _SPECS[flag]
