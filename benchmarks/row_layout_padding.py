"""Padding of the row-aligned flat layout (fsdp_plugin/_flat/rows.py) on realistic units, no training.

For each unit (one transformer block, registration order) and shard size N: elements added by the row
alignment (gaps + chunk rounding) beyond the old layout's ``ceil(total/N)*N``, as a fraction of the unit's
elements and in rows of the widest row; and how many 2-D matrices end up cut (split) between ranks.
Pure arithmetic on shapes: the numbers are exact, machine load does not matter.

    python benchmarks/row_layout_padding.py
"""
from __future__ import annotations

import math

from fsdp_plugin._flat.rows import piece, row_aligned_offsets, row_numel


def llama_block(d, ff, kv=None):
    kv = kv or d
    return [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff), (d,), (d,)]


def gpt2_block(d=768):
    return [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]


def moe_block(d, ff, experts, kv=None):
    """Mixtral-like, experts as 3-D stacks (transformers >= 5 fuses gate/up): one row = one expert matrix."""
    kv = kv or d
    return [(d, d), (kv, d), (kv, d), (d, d), (experts, d), (experts, 2 * ff, d), (experts, d, ff), (d,), (d,)]


UNITS = {
    "llama-7b block": llama_block(4096, 11008),
    "llama-8b block (GQA)": llama_block(4096, 14336, 1024),
    "gpt-2 small block": gpt2_block(),
    "mixtral-like block (8 x 3-D experts)": moe_block(4096, 14336, 8, 1024),
    "small moe block (64 x 3-D experts, d=1024, ff=512)": moe_block(1024, 512, 64),
}


def row(name: str, shapes: list, n: int) -> dict:
    total = sum(math.prod(s) for s in shapes)
    offsets, padded = row_aligned_offsets(shapes, n)
    old = -(-total // n) * n
    chunk = padded // n
    cut = sum(1 for s, o in zip(shapes, offsets) if len(s) == 2 and all(
        (lambda lo_hi: lo_hi[1] - lo_hi[0] < math.prod(s))(piece(o, math.prod(s), chunk, j)) for j in range(n)))
    extra = padded - old
    return {"unit": name, "N": n, "elements": total, "extra_padding": extra,
            "extra_pct": 100 * extra / total, "widest_rows": extra / max(row_numel(s) for s in shapes),
            "matrices_cut": cut}


def main() -> None:
    print(f"{'unit':52} {'N':>3} {'extra elems':>12} {'extra %':>8} {'in widest rows':>14} {'2-D cut':>7}")
    for name, shapes in UNITS.items():
        for n in (2, 4, 8, 16):
            r = row(name, shapes, n)
            print(f"{r['unit']:52} {n:>3} {r['extra_padding']:>12} {r['extra_pct']:>8.4f} {r['widest_rows']:>14.2f} "
                  f"{r['matrices_cut']:>7}")


if __name__ == "__main__":
    main()
