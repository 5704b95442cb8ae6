"""Lightning training script driven by tests/test_lightning_integration.py (run as a subprocess).

    python lightning_train.py --out OUT.json [--strategy fsdp_plugin|auto] [--devices N] [--max-steps N]
        [--deferred] [--precision FLAG] [--accumulate N] [--clip-val V --clip-algo norm|value]
        [--ckpt-dir DIR] [--save PATH] [--resume PATH] [--state-dict-type sharded|full] [--save-weights F]
        [--fsdp-kwargs] [--test CKPT] [--package lightning|pytorch_lightning]

Regression on a fixed synthetic dataset (32 samples, global batch 8 -> 4 steps per epoch, RankSampler), so
that any number of devices sees the same global batch. Rank 0 writes OUT.json with the global mean loss
of every micro-batch, keyed by global step, and facts about the strategy.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from torch import nn

# `--package pytorch_lightning`: the same script through the standalone package (`import pytorch_lightning as pl`)
if "pytorch_lightning" in sys.argv:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback, ModelCheckpoint
    from pytorch_lightning.plugins.io import AsyncCheckpointIO
else:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO

GLOBAL_BATCH = 8
DIM = 16


class Net(nn.Module):
    """Stem, a ModuleList of repeated blocks (the default wrap units), head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Regressor(pl.LightningModule):
    """``deferred=True`` builds the network in ``configure_model`` (deferred init); else in ``__init__``."""

    def __init__(self, deferred: bool = False, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = None if deferred else self._build()

    @staticmethod
    def _build() -> Net:
        torch.manual_seed(1234)  # same values whether built eagerly or deferred
        return Net()

    def configure_model(self) -> None:
        if self.net is None:
            self.net = self._build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x).float(), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, betas=(0.9, 0.95), weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.1 * torch.randn(32, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def reference_run(steps: int, accumulate: int = 1, clip: float | None = None) -> tuple[list, dict]:
    """Plain single-process PyTorch doing what the Trainer does on the same global batches.

    Returns the loss of every micro-batch (as ``LossRecorder`` records them: divided by ``accumulate``) and
    the final state dict.
    """
    model = Regressor()
    cfg = model.configure_optimizers()
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    x, y = dataset().tensors
    micro = GLOBAL_BATCH // accumulate
    losses, n = [], len(x) // micro
    for i in range(steps * accumulate):
        sl = slice((i % n) * micro, (i % n + 1) * micro)
        loss = nn.functional.mse_loss(model(x[sl]), y[sl])
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(float(loss.detach()) / accumulate)  # Lightning reports the normalized loss
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


class LossRecorder(Callback):
    """Records the global mean loss of each micro-batch (a collective: every rank runs it)."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = trainer.strategy.reduce(outputs["loss"].detach().float(), reduce_op="mean")
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.losses.append((trainer.global_step, float(loss), lr, batch_idx, float(batch[0].sum())))


class ResumeSampler(Callback):
    """On a resumed epoch, make the sampler skip the batches the checkpoint says were consumed."""

    def on_train_epoch_start(self, trainer, pl_module):
        loop = trainer.fit_loop.epoch_loop
        done = loop.batch_progress.current.ready if loop.restarting else 0
        trainer.train_dataloader.sampler.skip = done * trainer.train_dataloader.batch_size


class SaveAt(Callback):
    """``trainer.save_checkpoint(path)`` once, after optimizer step ``step`` (mid-fit)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path, self.done = step, path, False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.done:
            self.done = True
            trainer.save_checkpoint(self.path)


def forbid_pickle_loads() -> None:
    """Make every pickle-based checkpoint read fail: resuming must not need it."""
    from lightning.fabric.utilities import cloud_io

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint was read through torch.load/pickle")

    torch.load = cloud_io._load = refuse


def fsdp_strategy_kwargs() -> dict:
    """What a Lightning ``FSDPStrategy(...)`` user passes (torch's objects), fp32 so that parity stays 1e-5."""
    import functools

    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

    return {"sharding_strategy": ShardingStrategy.FULL_SHARD, "auto_wrap_policy": ModuleWrapPolicy({nn.Sequential}),
            "activation_checkpointing_policy": functools.partial(transformer_auto_wrap_policy,
                                                                 transformer_layer_cls={nn.Sequential}),
            "cpu_offload": CPUOffload(offload_params=False), "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
            "mixed_precision": MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32),
            "limit_all_gathers": True, "use_orig_params": True, "state_dict_type": "full"}


def stock_fsdp_strategy():
    """Lightning's own ``FSDPStrategy(state_dict_type="sharded")`` on CPU: a subclass passes the Trainer's
    GPU-only guard (it checks ``type(strategy) is FSDPStrategy``); :class:`StockRegressor` wraps its network
    in FSDP1 with ``device_id=cpu`` itself (Lightning then leaves the wrapped model as it is)."""
    from lightning.pytorch.strategies import FSDPStrategy

    class CpuFSDPStrategy(FSDPStrategy):
        pass

    return CpuFSDPStrategy(state_dict_type="sharded")


class StockRegressor(Regressor):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        if not isinstance(self.net, FSDP):
            self.net = FSDP(self.net, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
                            device_id=torch.device("cpu"), use_orig_params=True)


def build_strategy(args: argparse.Namespace):
    if args.strategy == "stock_fsdp":
        return stock_fsdp_strategy()
    if args.fsdp_kwargs:
        from fsdp_plugin.integrations.lightning import FSDPPluginStrategy

        return FSDPPluginStrategy(**fsdp_strategy_kwargs())  # was: FSDPStrategy(**fsdp_strategy_kwargs())
    if args.strategy != "fsdp_plugin":
        return args.strategy
    if args.state_dict_type == "sharded":
        return "fsdp_plugin"  # the registered name: `import fsdp_plugin` is the only change
    from fsdp_plugin.integrations.lightning import FSDPPluginStrategy

    return FSDPPluginStrategy(state_dict_type=args.state_dict_type)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategy", default="fsdp_plugin")
    p.add_argument("--package", default="lightning", choices=["lightning", "pytorch_lightning"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="cpu", help="cpu (the tests) or gpu (benchmarks/gpu/entry_points.py)")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--deferred", action="store_true")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--clip-val", type=float, default=None)
    p.add_argument("--clip-algo", default="norm")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--root-dir", default=None, help="Trainer(default_root_dir=...): its default ModelCheckpoint")
    p.add_argument("--save", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--state-dict-type", default="sharded")
    p.add_argument("--save-weights", default=None)
    p.add_argument("--save-at", nargs=2, default=None, metavar=("STEP", "PATH"))
    p.add_argument("--forbid-pickle", action="store_true")
    p.add_argument("--init-module", action="store_true", help="build under trainer.init_module(empty_init=True)")
    p.add_argument("--validate", action="store_true", help="trainer.validate after fit")
    p.add_argument("--fsdp-kwargs", action="store_true",
                   help="FSDPPluginStrategy(**Lightning FSDPStrategy kwargs), state_dict_type='full'")
    p.add_argument("--test", default=None, metavar="CKPT", help="only trainer.test(ckpt_path=CKPT), no fit")
    p.add_argument("--async-ckpt", action="store_true", help="plugins=[AsyncCheckpointIO()]")
    p.add_argument("--keep-last", nargs=2, default=None, metavar=("K", "DIR"),
                   help="ModelCheckpoint(DIR, every step, save_top_k=K of the highest steps): keep-last-k rotation")
    p.add_argument("--compile", default=None, metavar="BACKEND", help="trainer.fit(torch.compile(model, backend=...))")
    return p.parse_args()


def main() -> None:
    args = parse()
    import fsdp_plugin  # noqa: F401  - registers "fsdp_plugin" with Lightning

    if args.forbid_pickle:
        forbid_pickle_loads()
    pl.seed_everything(0, verbose=False)
    recorder = LossRecorder()
    callbacks = [recorder, ResumeSampler()]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(f"{args.ckpt_dir}/top", monitor="train_loss", save_top_k=1, save_last=True))
        callbacks.append(ModelCheckpoint(f"{args.ckpt_dir}/all", save_top_k=-1, every_n_epochs=1))
    if args.save_at:
        callbacks.append(SaveAt(int(args.save_at[0]), args.save_at[1]))
    if args.keep_last:
        callbacks.append(ModelCheckpoint(args.keep_last[1], monitor="step", mode="max",
                                         save_top_k=int(args.keep_last[0]), every_n_train_steps=1))
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, strategy=build_strategy(args), precision=args.precision,
        max_steps=args.max_steps, accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip_val,
        gradient_clip_algorithm=args.clip_algo, callbacks=callbacks, logger=False,
        enable_checkpointing=bool(args.ckpt_dir or args.root_dir or args.keep_last), enable_progress_bar=False,
        default_root_dir=args.root_dir,
        use_distributed_sampler=False, enable_model_summary=False, log_every_n_steps=2,  # comm stats: steps 2, 4
        plugins=[AsyncCheckpointIO()] if args.async_ckpt else None,
    )
    with trainer.init_module(empty_init=True) if args.init_module else contextlib.nullcontext():
        model = (StockRegressor if args.strategy == "stock_fsdp" else Regressor)(deferred=args.deferred)
    if args.test:
        return _test_only(args, trainer, model)
    per_rank = GLOBAL_BATCH // args.devices // args.accumulate
    loader = torch.utils.data.DataLoader(dataset(), batch_size=per_rank, sampler=RankSampler(32))
    trainer.fit(torch.compile(model, backend=args.compile) if args.compile else model, loader, ckpt_path=args.resume)
    args.comm = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("fsdp_plugin/")}
    if args.save:
        trainer.save_checkpoint(args.save)
    if args.validate:
        val_loader = torch.utils.data.DataLoader(dataset(), batch_size=32 // args.devices, sampler=RankSampler(32))
        args.val_loss = trainer.validate(model, val_loader, verbose=False)[0]["val_loss"]
    weights = _full_weights(trainer, model) if args.save_weights else None
    if trainer.is_global_zero:
        _report(args, trainer, model, recorder, weights)


def _test_only(args, trainer, model) -> None:
    """``trainer.test(ckpt_path=...)`` on the whole dataset; rank 0 reports the test loss."""
    loader = torch.utils.data.DataLoader(dataset(), batch_size=32 // args.devices, sampler=RankSampler(32))
    loss = trainer.test(model, loader, ckpt_path=args.test, verbose=False)[0]["test_loss"]
    if trainer.is_global_zero:
        with open(args.out, "w") as f:
            json.dump({"test_loss": loss, "world_size": trainer.world_size}, f)


class RankSampler(torch.utils.data.Sampler):
    """Rank r takes samples r, r+W, ... in order, every epoch: any world size sees the same global batches
    (Lightning's own DistributedSampler reshuffles per epoch, which makes resumed runs diverge)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.skip = 0  # samples to skip once (resuming mid-epoch, as a stateful loader would)

    def _rank_world(self) -> tuple[int, int]:
        dist = torch.distributed
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

    def __iter__(self):
        rank, world = self._rank_world()
        skip, self.skip = self.skip, 0
        return iter(range(rank, self.n, world)[skip:])

    def __len__(self) -> int:
        return self.n // self._rank_world()[1]


def _full_weights(trainer, model) -> dict:
    if args_strategy_is_ours(trainer):
        import fsdp_plugin as fp

        return fp.full_state_dict(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def args_strategy_is_ours(trainer) -> bool:
    return type(trainer.strategy).__name__ == "FSDPPluginStrategy"


def _report(args, trainer, model, recorder, weights) -> None:
    if weights is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, args.save_weights)
    opt = trainer.optimizers[0]
    info = {
        "losses": recorder.losses,
        "global_step": trainer.global_step,
        "world_size": trainer.world_size,
        "strategy": type(trainer.strategy).__name__,
        "strategy_module": type(trainer.strategy).__module__,
        "trainer_module": type(trainer).__module__,
        "lightning_imported": "lightning" in sys.modules,
        "precision_plugin": type(trainer.precision_plugin).__name__,
        "lr": opt.param_groups[0]["lr"],
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "launched_by": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "lightning",
        "val_loss": getattr(args, "val_loss", None),
        "comm": args.comm,  # the last optimizer step's fp.comm_stats, logged by the strategy
        "units": len(getattr(getattr(model, "_fp_root", None), "units", ()) or ()),
        "recomputed": sum("forward" in vars(m) for m in model.modules()),  # activation checkpointing wraps forward
        "compiled_units": sorted(u.name for u in getattr(getattr(model, "_fp_root", None), "units", ())
                                 if "_fp_eager_forward" in u.module.__dict__),
        "async_saves": getattr(trainer.strategy, "async_saves", 0),
        "scaler": type(getattr(trainer.precision_plugin, "scaler", None)).__module__ + "."
                  + type(getattr(trainer.precision_plugin, "scaler", None)).__name__,
        "device": str(next(model.parameters()).device),
    }
    mp = getattr(getattr(trainer.strategy, "precision_plugin", None), "mixed_precision", None)
    info["param_dtype"] = str(getattr(mp() if callable(mp) else None, "param_dtype", None))
    with open(args.out, "w") as f:
        json.dump(info, f)
    print("REPORT", json.dumps(info), file=sys.stderr)


if __name__ == "__main__":
    main()
