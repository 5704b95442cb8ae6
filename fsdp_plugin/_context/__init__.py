"""Context parallelism (``ShardingConfig(context_parallel=C)``): one sequence split over C consecutive ranks.

``split.py`` (the load-balanced layout, the split of one forward's inputs), ``attention.py`` (the registered
attention: all-gather K/V or Ulysses), ``blockwise.py`` (the all-gather attention, tile by tile with an online
softmax), ``tiles.py`` (which tiles a rank computes and their masks), ``loss.py`` (the whole batch's loss on
every rank), ``install.py`` (refusals at fp.shard, hooks on the root), ``public.py`` (data-parallel view, gather helper).
"""
from .install import install, refuse_unsplittable
from .public import data_parallel_rank, data_parallel_size, gather_sequence

__all__ = ["install", "refuse_unsplittable", "data_parallel_rank", "data_parallel_size", "gather_sequence"]
