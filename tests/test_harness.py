import pytest
import torch
import torch.distributed as dist

from _dist import RankFailure, run_ranks


def _sum_ranks(rank, world):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # would hang forever without the harness killing it


def test_run_ranks_collects_results():
    assert run_ranks(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_first_failure_kills_all_ranks():
    with pytest.raises(RankFailure, match="boom on rank 1"):
        run_ranks(_fail_on_one, 2, timeout=30)
