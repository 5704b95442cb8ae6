"""``fp.join(model)``: evaluation forwards whose number differs per rank (``_schedule/eval_join.py``).

A tiny Llama, sharded at world 2 (every forward all-gathers the units). Rank 0 evaluates 3 batches, rank 1 one
(or none, with ``example=``); the per-rank loss sums reduced after the block equal one process's sum over
all batches, and a training step afterwards equals one process's step on the global batch. Without the
block the same loop ends in a CollectiveError (the ranks' all-gathers stop pairing), which the join's count
is what prevents.
"""
from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

import fsdp_plugin as fp

tf = pytest.importorskip("transformers")

torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # import torch._dynamo once, before forking ranks

VOCAB, SEQ, TOL = 96, 8, 1e-5
BATCHES = {0: 3, 1: 1}


def _model():
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return tf.LlamaForCausalLM(cfg)


def _batch(rank: int, i: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(10 * rank + i))


def _eval_sum(model, batches) -> float:
    return sum(float(model(input_ids=x, labels=x).loss) for x in batches)


def _train_step(model, xs) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(input_ids=xs, labels=xs).loss
    loss.backward()
    opt.step()
    return float(loss)


def _worker(rank, world, batches, use_example):
    import torch.distributed as dist

    model = _model()
    fp.shard(model, timeout_s=60)
    model.eval()
    mine = [_batch(rank, i) for i in range(batches[rank])]
    example = {"input_ids": _batch(rank, 99)} if use_example else None
    with torch.no_grad(), fp.join(model, example=example) as state:
        total = torch.tensor(_eval_sum(model, mine), dtype=torch.float64)
    dist.all_reduce(total)
    model.train()
    loss = torch.tensor(_train_step(model, _batch(rank, 50)))
    dist.all_reduce(loss)
    return float(total), float(loss) / world, state.forwards, state.shadowed


@pytest.mark.parametrize("batches,use_example", [(BATCHES, False), ({0: 2, 1: 0}, True)],
                         ids=["3-and-1", "2-and-none-with-example"])
def test_uneven_evaluation_matches_one_process(batches, use_example):
    model = _model().eval()
    with torch.no_grad():
        want_total = _eval_sum(model, [_batch(r, i) for r in range(2) for i in range(batches[r])])
    model.train()
    want_loss = _train_step(model, torch.cat([_batch(r, 50) for r in range(2)]))
    got = run_ranks(_worker, 2, batches, use_example, timeout=180)
    for rank, (total, loss, forwards, shadowed) in enumerate(got):
        assert abs(total - want_total) <= TOL * max(1.0, abs(want_total)), (rank, total, want_total)
        assert abs(loss - want_loss) <= TOL, (rank, loss, want_loss)
        assert forwards == batches[rank] and shadowed == max(batches.values()) - batches[rank], (rank, forwards, shadowed)


def _refusal_worker(rank, world, case):
    model = _model()
    fp.shard(model, timeout_s=60)
    if case == "grad":
        with pytest.raises(fp.UsageError, match="torch.no_grad"), fp.join(model):
            model(input_ids=_batch(rank, 0))
        return "ok"
    with pytest.raises(fp.UsageError, match="example="):
        with torch.no_grad(), fp.join(model):
            for i in range(1 - rank):        # rank 1 runs no forward and has no example
                model(input_ids=_batch(rank, i))
    return "ok"


@pytest.mark.parametrize("case", ["grad", "no-input"])
def test_join_refusals_raise_on_every_rank(case):
    assert run_ranks(_refusal_worker, 2, case, timeout=120) == ["ok", "ok"]
