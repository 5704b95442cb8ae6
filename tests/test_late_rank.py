"""A deadline names the late rank: what it was last doing, since when, and where its Python thread is now,
read from the rendezvous store (no collective); every rank writes its last collectives to a trace file."""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

import fsdp_plugin as fp
from _dist import run_ranks
from fsdp_plugin._comm import late, status
from models import GPT, Block, gpt_batch

TIMEOUT_S = 4


def _load_next_batch():
    time.sleep(TIMEOUT_S + 4)     # alive, but stuck in its data loader past the others' deadline
    os._exit(0)


def _third_step_stalls(rank, world, trace_dir):
    os.environ["FSDP_PLUGIN_TRACE_DIR"] = trace_dir
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, timeout_s=TIMEOUT_S)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        for step in range(4):
            if rank == 2 and step == 2:
                _load_next_batch()
            start = time.monotonic()
            model(*gpt_batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
    except fp.CollectiveError as e:
        time.sleep(2 * status.INTERVAL_S + 0.5)    # let the late rank's thread write its trace
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_the_deadline_names_the_rank_that_did_not_arrive(tmp_path):
    results = run_ranks(_third_step_stalls, 3, str(tmp_path), timeout=90, may_die={2})
    for rank in (0, 1):
        msg, waited = results[rank]
        assert f"rank {rank}: " in msg and "did not complete within 4s" in msg, msg
        assert "step 3" in msg, msg                                  # the root's third forward
        assert "Not arrived at #" in msg and "rank 2 (host" in msg, msg
        assert "now at test_late_rank.py:" in msg and "in _load_next_batch" in msg, msg
        assert "Waiting in #" in msg and f"rank(s) {1 - rank}." in msg, msg
        assert "timeout_s" in msg and str(tmp_path) in msg, msg
        assert waited < TIMEOUT_S + 4, waited
    files = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "rank*.log")))
    assert files == ["rank00000.log", "rank00001.log", "rank00002.log"], files
    mine = (tmp_path / "rank00000.log").read_text().splitlines()
    assert any("WAITING" in ln and "all-gather of unit" in ln for ln in mine), mine[-5:]
    assert sum(" done " in ln for ln in mine) > 10, mine
    theirs = (tmp_path / "rank00002.log").read_text()
    assert "asked by rank" in theirs and "_load_next_batch" in theirs, theirs


def _status(rank, seq, cur=None, last=None, where=None, age=0.0):
    now = time.time()
    return {"rank": rank, "host": "h", "pid": 100 + rank, "t": now - age, "step": 3, "seq": {"0": seq},
            "cur": cur, "last": last, "where": where}


def test_the_report_sorts_ranks_into_late_waiting_ahead_and_silent():
    op = status._Op(37, "0", "all_gather", 3, 10)
    now = time.time()
    statuses = {
        1: _status(1, 37, cur=[37, "0", "#37 all-gather of unit '0' (group 0, step 3)", now - 4]),
        2: _status(2, 29, last=[29, "0", "#29 gradient reduction of unit '1' (group 0, step 2)", now - 4.3],
                   where="train.py:57 in next_batch"),
        3: _status(3, 30, cur=[5, "7", "#5 all-reduce (group 7, step 2)", now - 9], age=30),
        4: None,
        5: _status(5, 40, cur=[40, "0", "#40 all-reduce (group 0, step 4)", now]),
    }
    text = late._describe(op, statuses)
    assert ("Not arrived at #37: rank 2 (host h, pid 102) last finished #29 gradient reduction of unit '1' "
            "(group 0, step 2) 4.3s ago, now at train.py:57 in next_batch (its status of 0.0s ago)") in text, text
    assert "rank 3 (host h, pid 103) waits in #5 all-reduce (group 7, step 2) since 9.0s ago" in text, text
    assert "stopped updating 30s ago: the process is dead or frozen" in text, text
    assert "No status from rank(s) 4" in text and "Rank(s) 5 already issued #37 and more" in text, text
    assert "Waiting in #37 too: rank(s) 1." in text, text


def test_rank_lists_are_compressed():
    assert late.ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"
    assert late.ranges([]) == ""


def test_a_trace_line_is_readable():
    op = status._Op(12, "0", "reduce_scatter", 2, 4096)
    op.what = "gradient reduction of unit 'blocks.1'"
    op.t_wait = op.t_done = op.t_issue
    line = status.trace_line(op)
    assert line.split()[:8] == ["#12", "group", "0", "reduce_scatter", "step", "2", "numel", "4096"], line
    assert line.endswith("done     gradient reduction of unit 'blocks.1'"), line


def _lightning_rank_stalls(rank, world, trace_dir):
    """The Lightning Trainer on forked ranks (the process group exists; LOCAL_RANK set: no launcher)."""
    os.environ["FSDP_PLUGIN_TRACE_DIR"] = trace_dir
    import lightning.pytorch as pl

    from fsdp_plugin.integrations.lightning import FSDPPluginStrategy

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))

        def training_step(self, batch, i):
            if rank == 1 and i == 2:
                _load_next_batch()
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    trainer = pl.Trainer(strategy=FSDPPluginStrategy(auto_wrap_policy={torch.nn.Linear}, timeout_s=TIMEOUT_S),
                         accelerator="cpu", devices=world, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    try:
        trainer.fit(Module(), torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=2))
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_lightning_shows_the_same_message(tmp_path):
    pytest.importorskip("lightning")
    msg = run_ranks(_lightning_rank_stalls, 2, str(tmp_path), timeout=120, may_die={1})[0]
    assert "Not arrived at #" in msg and "rank 1 (host" in msg and "in _load_next_batch" in msg, msg


ACCELERATE_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_SHARDING_STRATEGY": "FULL_SHARD",
                  "FSDP_SYNC_MODULE_STATES": "false", "FSDP_AUTO_WRAP_POLICY": "NO_WRAP", "FSDP_VERSION": "1",
                  "FSDP_RESHARD_AFTER_FORWARD": "full_shard", "FSDP_CPU_RAM_EFFICIENT_LOADING": "false",
                  "ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "localhost", "MASTER_PORT": "0",
                  "FSDP_PLUGIN_TIMEOUT_S": str(TIMEOUT_S)}


def _accelerate_rank_stalls(rank, world, trace_dir):
    os.environ["FSDP_PLUGIN_TRACE_DIR"] = trace_dir
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # the forked parent may hold accelerate singletons
    GradientState._reset_state()
    from fsdp_plugin.integrations.accelerate import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        for i in range(4):
            if rank == 1 and i == 2:
                _load_next_batch()
            acc.backward(model(torch.randn(2, 4)).sum())
            opt.step()
            opt.zero_grad()
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_accelerate_shows_the_same_message(tmp_path):
    pytest.importorskip("accelerate")
    msg = run_ranks(_accelerate_rank_stalls, 2, str(tmp_path), timeout=120, env=ACCELERATE_ENV, may_die={1})[0]
    assert "Not arrived at #" in msg and "rank 1 (host" in msg and "in _load_next_batch" in msg, msg


def _second_step_dies(rank, world, trace_dir):
    os.environ["FSDP_PLUGIN_TRACE_DIR"] = trace_dir
    torch.manual_seed(0)
    model = fp.shard(GPT(), auto_wrap_policy={Block}, timeout_s=20)
    try:
        for step in range(3):
            if rank == 1 and step == 1:
                time.sleep(2 * status.INTERVAL_S + 0.2)     # its status shows where it was last
                os._exit(1)                                 # killed (OOM killer, a crash in C++ ...)
            model(*gpt_batch(step, rank)).backward()
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_a_dead_peer_is_named_too(tmp_path):
    msg = run_ranks(_second_step_dies, 2, str(tmp_path), timeout=90, may_die={1})[0]
    assert "failed (" in msg and "Another rank probably died or was killed. Not arrived at #" in msg, msg
    assert "rank 1 (host" in msg, msg
    assert "in _second_step_dies" in msg, msg


def test_where_names_the_library_line_and_the_user_line_that_called_it():
    import queue
    import threading

    q = queue.Queue()

    def next_batch():
        q.get()                   # a data loader waiting for a worker

    t = threading.Thread(target=next_batch)
    t.start()
    time.sleep(0.2)
    try:
        where = status._where(t.ident)
    finally:
        q.put(None)
        t.join()
    assert where.startswith("threading.py:") and "(from test_late_rank.py:" in where, where
    assert where.endswith("in next_batch)"), where


def _trainer_rank_stalls(rank, world, trace_dir):
    """transformers' Trainer with fsdp_plugin (the one-line import), FSDP selected by accelerate's env."""
    os.environ["FSDP_PLUGIN_TRACE_DIR"] = trace_dir
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    import fsdp_plugin.integrations.transformers as integration
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    integration.install()   # what the one-line import does in a fresh process (an earlier test may have undone it)

    class Stall(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if rank == 1 and state.global_step == 2:
                _load_next_batch()

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (32, 8))
    args = TrainingArguments(output_dir=trace_dir, per_device_train_batch_size=2, max_steps=4, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=100)
    trainer = Trainer(LlamaForCausalLM(cfg), args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                      callbacks=[Stall()])
    try:
        trainer.train()
    except fp.CollectiveError as e:
        return str(e)
    return "no error"


def test_the_trainer_shows_the_same_message(tmp_path):
    pytest.importorskip("transformers")
    msg = run_ranks(_trainer_rank_stalls, 2, str(tmp_path), timeout=180, env=ACCELERATE_ENV, may_die={1})[0]
    assert "Not arrived at #" in msg and "rank 1 (host" in msg and "in _load_next_batch" in msg, msg
