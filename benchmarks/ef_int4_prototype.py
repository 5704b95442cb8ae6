"""Prototype, not shipped: error feedback on int4 gradient reduce-scatters, measured on the demo GPT (RESULTS § 35i).

Each rank adds to the rows it sends the rounding error it left in the same unit's rows at the previous step
(``residual = sent_exact - dequantized``; its own row, summed exact, keeps none), so quantization error is
carried forward instead of lost. Installed by patching ``_comm.quantized.reduce_scatter`` in each rank of
``benchmarks/quantized_gpt.py`` (full_shard, world 2: reduce-scatters only); residuals are keyed by the call's
position in the step (reset at every optimizer step), which holds for this fixed schedule only.

    python benchmarks/ef_int4_prototype.py --steps 300 --noise-seed 0 --configs "exact,int4 gradients"
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantized_gpt as qg  # noqa: E402

_noise_source = qg._noise_source


def _install(args, rank: int) -> None:
    _noise_source(args, rank)
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from fsdp_plugin._comm import collectives as comm
    from fsdp_plugin._comm import quantized as qz
    state = {"i": 0, "residual": {}}
    register_optimizer_step_pre_hook(lambda *a: state.__setitem__("i", 0))
    exact = qz.reduce_scatter

    def reduce_scatter(quant, out, grad, group, gate=None, what="reduce-scatter"):
        if not qz.applies(quant, "gradients", group):
            return exact(quant, out, grad, group, gate, what)
        n, me = comm.group_size(group), comm.rank_in(group)
        rows = grad.view(n, -1).float()
        key, state["i"] = state["i"], state["i"] + 1
        carried = state["residual"].get(key)
        sending = rows + carried if carried is not None and carried.shape == rows.shape else rows.clone()
        length, block, bits = rows.shape[1], quant.block_size, qz.bits_of(quant, "gradients")
        sent = qz.quantize(sending, block, stochastic=True, bits=bits)
        residual = sending - qz.dequantize(sent, length, block, bits)
        residual[me] = 0
        state["residual"][key] = residual
        got = torch.empty_like(sent)
        work = comm.exchange(got, sent, group, kind=qz.gradients_kind(bits), gate=gate, what=what)

        def then() -> None:
            out.copy_(qz._sum_rows(got, rows[me], me, length, block, bits))
        return qz._Then(work, then)
    qz.reduce_scatter = reduce_scatter


qg._noise_source = _install      # spawned ranks re-import this script as their main module: patched there too

if __name__ == "__main__":
    qg.main()
