"""The row-aligned flat layout: every cut falls between rows, pieces keep their ndim, padding stays small,
and fp.plan's byte model pads exactly like the engine."""
import math

import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import fsdp_plugin as fp
from _dist import run_ranks
from fsdp_plugin._flat.rows import local_shape, piece, row_aligned_offsets, row_numel

shapes = st.lists(st.one_of(st.tuples(st.integers(0, 9)),
                            st.tuples(st.integers(0, 9), st.integers(1, 9)),
                            st.tuples(st.integers(1, 4), st.integers(1, 5), st.integers(1, 5))), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(shapes, st.integers(1, 8))
def test_cuts_fall_between_rows(shapes, n):
    offsets, padded = row_aligned_offsets(shapes, n)
    total = sum(math.prod(s) for s in shapes)
    assert padded % n == 0 and padded >= total
    chunk = padded // n
    end = 0
    for s, o in zip(shapes, offsets):
        assert o >= end, "parameters never overlap and keep their order"
        numel = math.prod(s)
        end = o + numel
        for j in range(n):
            lo, hi = piece(o, numel, chunk, j)
            assert lo % row_numel(s) == 0 and hi % row_numel(s) == 0, (s, o, j)
            shp = local_shape(s, lo, hi)
            assert math.prod(shp) == hi - lo and (len(shp) == len(s) or len(s) == 0)
    assert end <= padded
    # padding beyond the old layout: under one row per cut (n - 1) plus the chunk rounding (n rows per
    # multi-chunk width); with tiny shapes this bound is loose, the benchmark reports real units
    widest = max(row_numel(s) for s in shapes)
    assert padded - (-(-total // n) * n) <= n * math.lcm(*[row_numel(s) for s in shapes]) + n * widest


def test_a_cut_matrix_is_whole_rows_on_each_rank():
    assert row_aligned_offsets([(7, 8), (7,), (5, 7), (5,)], 2) == ([7, 63, 70, 105], 110)
    assert piece(7, 56, 55, 0) == (0, 48) and local_shape((7, 8), 0, 48) == (6, 8)
    assert piece(7, 56, 55, 1) == (48, 56) and local_shape((7, 8), 48, 56) == (1, 8)
    assert local_shape((7, 8), 0, 0) == (0, 8) and local_shape((7, 8), 0, 56) == (7, 8)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(d, 3 * d), nn.Linear(3 * d, d), nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(x + self.down(torch.relu(self.up(x))))


def _padded(rank, world):
    from fsdp_plugin.planner._units import discover_units
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 6), Block(6), Block(6), nn.Linear(6, 11))
    _, specs = discover_units(model, {Block})
    predicted = [h.padded(world) for h in specs]
    fp.shard(model, auto_wrap_policy={Block})
    built = [h.padded for u in model._fp_root.units for h in u.handles]
    dims = {n: (p.dim(), tuple(p.shape[1:])) for n, p in model.named_parameters()}
    return predicted, built, dims


def test_planner_pads_like_the_engine_and_ndim_agrees_across_ranks():
    results = run_ranks(_padded, 3)
    for predicted, built, dims in results:
        assert sorted(predicted) == sorted(built)
        assert dims == results[0][2], "p.ndim / p.shape[1:] routing gives the same groups on every rank"
