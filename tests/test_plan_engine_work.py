"""The replay's engine work against a real step: the bytes the engine's own kernels read and write (flat
gradients, the gloo point-to-point sums and receive buffers, the quantized path's copies and float32 sums),
priced with the fake run's rule (`_fake_run.op_cost`) in both, so `_time.predict` divides them by the rate the
calibration measured in the same units. Counted, not timed: load-independent."""
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_plugin as fp
from fsdp_plugin.planner import _world
from fsdp_plugin.planner._fake_run import op_cost
from fsdp_plugin.planner._recommend import resolve
from tests._dist import run_ranks
from tests.models import GPT, Block, gpt_batch

_PKG = fp.__file__.rsplit("/", 1)[0] + "/"

CASES = {"full_shard": {}, "hybrid_shard": {"sharding_strategy": "hybrid_shard"},
         "hpz": {"reshard_after_forward": "node"},
         "hybrid_q8g": {"sharding_strategy": "hybrid_shard", "quantization": fp.Quantization(gradients="int8")},
         "full_q8": {"quantization": fp.Quantization(weights="int8", gradients="int8")},
         "hybrid_q4g": {"sharding_strategy": "hybrid_shard", "quantization": fp.Quantization(gradients="int4")},
         "full_q8w_q4g": {"quantization": fp.Quantization(weights="int8", gradients="int4")},
         "zeropp": {"reshard_after_forward": "node", "quantization": fp.Quantization(weights="int8", gradients="int8")}}


# the quantization's kernels, priced per element by the calibration rather than by their bytes
_KERNELS = ("quantize", "_quantize_tile", "_stochastic_biased", "_pack4", "dequantize", "dequantize_into",
            "dequantize_rows_into", "_tile_codes", "_unpack4", "_scales")


class _EngineBytes(TorchDispatchMode):
    """Bytes (op_cost's rule) of the aten kernels whose innermost package frame is the engine's, outside the
    quantization's own quantize/dequantize (priced per element by the calibration) and gloo's c10d ops."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind, amount = op_cost(func, args, kwargs, out)
        if kind == "bytes" and func.namespace != "c10d" and self._engine(sys._getframe(1)):
            self.bytes += amount
        return out

    @staticmethod
    def _engine(frame) -> bool:
        while frame is not None:
            f = frame.f_code.co_filename
            if f.startswith(_PKG) and "/planner/" not in f:
                name = frame.f_code.co_name
                return not (f.endswith("_comm/quantized.py") and name in _KERNELS)
            if "/torch/optim/" in f or f.endswith("tests/models.py"):
                return False
            frame = frame.f_back
        return False


def _engine(rank, world, kwargs):
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, **kwargs)
    opt = torch.optim.AdamW(model.parameters())
    model(*gpt_batch(0, rank)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    mode = _EngineBytes()
    with mode:
        model(*gpt_batch(1, rank)).backward()
    return mode.bytes


def _planned(monkeypatch, world, per_node, kwargs) -> int:
    seen = {}
    real = _world.replay

    def replay(*a, **k):
        res = real(*a, **k)
        seen["engine_bytes"] = res.engine_bytes
        return res
    monkeypatch.setattr(_world, "replay", replay)
    fp.plan(GPT, world_size=world, auto_wrap_policy={Block}, inputs=lambda: gpt_batch(0, 0), nodes=2,
            link_gbps=1, device="cpu", **kwargs)
    return seen["engine_bytes"]


@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
def test_replayed_engine_bytes_equal_the_real_steps(monkeypatch, name, per_node):
    kwargs = resolve(CASES[name], per_node)
    real = run_ranks(_engine, 2 * per_node, kwargs, env={"LOCAL_WORLD_SIZE": str(per_node)})
    planned = _planned(monkeypatch, 2 * per_node, per_node, kwargs)
    assert planned == pytest.approx(max(real), rel=0.03), (planned, real)
