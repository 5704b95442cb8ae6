"""Error feedback for quantized gradient reductions (``Quantization(error_feedback=True)``).

Each handle keeps, per hop (its shard reduce-scatter, its replica all-reduce and that all-reduce's
re-quantized sums), the float32 rounding error its last quantization left in the rows this rank SENT:
``residual = sent_exact − dequantized``. The next reduction on that hop adds it to the rows before
quantizing, so an error is carried into the next step instead of lost (Seide et al. 2014; 1-bit Adam): over
steps the dequantized sums track the exact ones with an error that does not accumulate, which is what lets
int4 train as close to exact as int8 does (RESULTS § 35i). This rank's own row is summed exact by the
receiver and keeps no residual.

Invariants: a residual has the shape of the rows it corrects (a different shape -- a new layout -- starts
from zero); it is float32, finite (a non-finite gradient, an fp16 overflow the scaler skips, leaves zeros,
not NaN, for every later step) and per rank (never communicated, never checkpointed: a resumed run starts
from zero, an error of one step's quantization). Memory per rank: ``(n − 1)/n`` of the unit's reduced
gradient for an n-rank reduce-scatter, the whole reduced tensor for an all-reduce (``fp.plan`` prices it).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import quantized as qz


class Feedback:
    """One handle's residuals by hop name. ``add`` before quantizing, ``keep`` after; ``clear`` drops all."""

    def __init__(self) -> None:
        self._residuals: dict = {}

    def add(self, hop: str, rows: torch.Tensor, skip: Optional[int] = None) -> None:
        """Add ``hop``'s residual into ``rows`` (R, L) float32, in place, except row ``skip`` (this rank's own,
        not sent); nothing on a hop's first call or when the layout changed."""
        res = self._residuals.get(hop)
        if res is None or res.shape != _kept_shape(rows, skip):
            return
        for (lo, hi), at in _parts(rows.shape[0], skip):
            rows[lo:hi].add_(res[at:at + hi - lo])

    def keep(self, hop: str, rows: torch.Tensor, payload: torch.Tensor, block: int, bits: int,
             skip: Optional[int] = None) -> None:
        """Store ``rows − dequantize(payload)`` (the error of the rows just quantized into ``payload``) as
        ``hop``'s residual, row ``skip`` left out, non-finite entries as 0. Reuses the previous buffer."""
        shape = _kept_shape(rows, skip)
        res = self._residuals.get(hop)
        if res is None or res.shape != shape:
            res = self._residuals[hop] = torch.empty(shape, dtype=torch.float32, device=rows.device)
        length = rows.shape[1]
        for (lo, hi), at in _parts(rows.shape[0], skip):
            torch.sub(rows[lo:hi], qz.dequantize(payload[lo:hi], length, block, bits), out=res[at:at + hi - lo])
        torch.nan_to_num_(res, nan=0.0, posinf=0.0, neginf=0.0)

    def clear(self) -> None:
        self._residuals.clear()

    @property
    def nbytes(self) -> int:
        """Bytes of residuals held (per rank)."""
        return sum(r.numel() * r.element_size() for r in self._residuals.values())


def _kept_shape(rows: torch.Tensor, skip: Optional[int]) -> tuple:
    return (rows.shape[0] - (skip is not None), rows.shape[1])


def _parts(n: int, skip: Optional[int]) -> list:
    """((lo, hi), offset in the residual) of the row ranges kept: every row but ``skip``."""
    if skip is None:
        return [((0, n), 0)]
    return [(r, r[0] - (r[0] > skip)) for r in ((0, skip), (skip + 1, n)) if r[1] > r[0]]


def residual_elems(op: str, elems: int, n: int) -> int:
    """float32 elements one rank's residuals take for one handle's quantized reduction of ``elems`` over
    ``n`` ranks (``_comm/quantized``'s forms): a reduce-scatter keeps the n − 1 rows it sends; an all-reduce
    of two keeps its whole tensor, of more its scatter rows and its re-quantized sums (n rows of ceil(E/n))."""
    if n <= 1:
        return 0
    if op == "reduce_scatter":
        return (n - 1) * (elems // n)
    return elems if n == 2 else n * -(-elems // n)
