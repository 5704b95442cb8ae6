"""Every checkpoint collective has a deadline: a rank that dies (or stalls) in the middle of a save, a load,
load_pretrained, save_pretrained or a gathering save_pretrained makes the others raise CollectiveError naming
the operation, within ShardingConfig(timeout_s=...), instead of waiting for torch's default timeout."""
from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import save_file

import fsdp_plugin as fp
from _dist import run_ranks
from fsdp_plugin.checkpoint import _comm, load, save
from fsdp_plugin.checkpoint.hf import hf

TIMEOUT_S = 4


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(16))

    def forward(self, x):
        return self.b(self.a(x)) * self.scale


def _die(*_a, **_k):
    os._exit(7)        # no cleanup, no goodbye: like a rank killed by the OOM killer


def _stall(*_a, **_k):
    time.sleep(TIMEOUT_S + 2)   # alive but absent (stuck in I/O, say), past the others' deadline
    os._exit(0)


def _prepare(op: str, tmp: str, model) -> None:
    """What each operation needs before the fault (a checkpoint / an HF directory to load)."""
    if op == "load_checkpoint":
        fp.save_checkpoint(os.path.join(tmp, "ckpt"), model)
    if op == "load_pretrained" and _comm.rank() == 0:
        save_file({k: v.clone() for k, v in Net().state_dict().items()}, os.path.join(tmp, "model.safetensors"))
    _comm.barrier()


def _run(op: str, tmp: str, model):
    if op == "save_checkpoint":
        fp.save_checkpoint(os.path.join(tmp, "ckpt"), model)
    elif op == "load_checkpoint":
        fp.load_checkpoint(os.path.join(tmp, "ckpt"), model)
    elif op == "load_pretrained":
        fp.load_pretrained(model, tmp)
    else:
        fp.save_pretrained(model, os.path.join(tmp, "hf"), gather=op == "save_pretrained_gather")


# where rank 1 fails: in the middle of the operation, after its first collectives
FAULT_AT = {"save_checkpoint": (save, "_write_files"), "load_checkpoint": (load, "_load_local"),
            "load_pretrained": (hf, "_load_local"), "save_pretrained": (hf, "_write_all"),
            "save_pretrained_gather": (_comm, "send")}


def _one_rank_fails(rank, world, op, tmp, fault):
    torch.manual_seed(0)
    model = fp.shard(Net(), auto_wrap_policy={torch.nn.Linear}, timeout_s=TIMEOUT_S)
    _prepare(op, tmp, model)
    if rank == 1:
        module, name = FAULT_AT[op]
        assert callable(getattr(module, name, None)), f"fault point {module.__name__}.{name} no longer exists"
        setattr(module, name, _die if fault == "dies" else _stall)
    start = time.monotonic()
    try:
        _run(op, tmp, model)
    except fp.CollectiveError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", time.monotonic() - start


@pytest.mark.parametrize("op", list(FAULT_AT))
def test_a_rank_killed_mid_operation_becomes_a_collective_error(op, tmp_path):
    cls, msg, waited = run_ranks(_one_rank_fails, 2, op, str(tmp_path), "dies", timeout=60, may_die={1})[0]
    assert cls == "CollectiveError", (cls, msg)
    assert op.removesuffix("_gather") in msg and "rank 0" in msg, msg
    assert waited < TIMEOUT_S + 2, waited


@pytest.mark.parametrize("op", ["save_checkpoint", "save_pretrained_gather"])
def test_a_stalled_rank_becomes_a_collective_error_within_timeout_s(op, tmp_path):
    cls, msg, waited = run_ranks(_one_rank_fails, 2, op, str(tmp_path), "stalls", timeout=60, may_die={1})[0]
    assert cls == "CollectiveError" and f"within {TIMEOUT_S}s" in msg and op.removesuffix("_gather") in msg, msg
    assert TIMEOUT_S - 0.5 < waited < TIMEOUT_S + 3, waited


def _lightning_broadcast_and_reduce(rank, world):
    from fsdp_plugin.integrations.lightning import _plumbing as _common
    cfg = fp.ShardingConfig(timeout_s=TIMEOUT_S)
    value = {"best": "/ckpt/epoch=1.ckpt", "score": torch.tensor(0.5), "shape": (2, 3)} if rank == 1 else None
    got = _common.broadcast(cfg, value, src=1)
    try:
        _common.broadcast(cfg, object() if rank == 0 else None, src=0)
        err = "no error"
    except fp.CodecError as e:
        err = str(e)
    mean = _common.reduce(cfg, torch.tensor([float(rank + 1)]), None, "mean")
    total = _common.reduce(cfg, torch.tensor([rank + 1]), None, "sum")
    top = _common.reduce(cfg, torch.tensor([float(rank)]), None, "max")
    return got, err, (mean.item(), total.item(), top.item())


def test_lightning_broadcast_and_reduce_go_through_our_collectives():
    import fsdp_plugin.integrations.lightning._plumbing  # noqa: F401 - imported once here, inherited by the forks
    for got, err, reduced in run_ranks(_lightning_broadcast_and_reduce, 2, timeout=60):
        # broadcast: JSON codec, no pickle; an unencodable value fails on every rank
        assert got["best"] == "/ckpt/epoch=1.ckpt" and got["shape"] == (2, 3) and got["score"].item() == 0.5
        assert "strategy.broadcast from rank 0" in err and "pickle" in err, err
        assert reduced == (1.5, 3, 1.0)   # Lightning's semantics: mean = sum / world, in place
