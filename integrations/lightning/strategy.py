"""``FSDPPluginStrategy``: the Lightning Trainer strategy ``"fsdp_plugin"`` on the fsdp_plugin engine.

Usage: ``import fsdp_plugin`` then ``Trainer(strategy="fsdp_plugin")`` (or
``Trainer(strategy=FSDPPluginStrategy(auto_wrap_policy={Block}, state_dict_type="full"))``).
Works on CPU (gloo) and CUDA (NCCL), with Lightning's launcher or torchrun.

It is a ``ParallelStrategy`` (not Lightning's FSDPStrategy): the LightningModule itself is sharded in
place by ``fp.shard`` (no wrapper), its step methods run through the root unit's hooks
(``fp.register_forward_method``), ``configure_model`` runs under ``fp.deferred_init()`` and checkpoints
are pickle-free (see ``_checkpoint``).

Limitations:

* Lightning code that reads checkpoints without this strategy (``LightningModule.load_from_checkpoint``,
  ``torch.load``) reads ``state_dict_type="full"`` files directly; a sharded directory first goes through
  ``fsdp-plugin consolidate CKPT OUT.ckpt --format lightning`` (no process group needed).
* In sharded mode the engine writes the weights: edits to ``checkpoint["state_dict"]`` made in
  ``on_save_checkpoint`` are ignored (as with FSDPStrategy's distributed checkpoints).
* ``state_dict_type="full"`` stores the optimizers' param-group hyper-parameters but not their
  per-parameter state: resuming from it restarts e.g. Adam's moments.
* Weights loaded inside ``configure_model`` go through deferred init; prefer loading pretrained weights
  after setup with ``fp.load_pretrained``, or build the model outside ``configure_model``.
* ``sync_batchnorm=True`` (torch's SyncBatchNorm needs CUDA) is not reverted after ``fit``.

Ranks may have different numbers of training batches: each training epoch runs inside torch's ``Join`` (see
``_uneven``: a rank out of batches shadows the others' steps, gradients divided by the world size), and of
validation/test batches: those epochs run inside ``fp.join`` (``_uneven_eval``).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from fsdp_plugin.checkpoint import storage
from fsdp_plugin.integrations import _pending_save as pending_save
from fsdp_plugin.integrations.lightning import _compile, _uneven, _uneven_eval
from fsdp_plugin.integrations.lightning import _tensor_parallel as tp2d
from fsdp_plugin.integrations.lightning.checkpoint import async_save as _async_save
from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt
from fsdp_plugin.integrations.lightning.checkpoint import stock as stock_ckpt
from fsdp_plugin.integrations.lightning import _plumbing as common
from fsdp_plugin.integrations.lightning.precision import FSDPPluginPrecision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

import fsdp_plugin as fp
from fsdp_plugin.errors import ConfigError, UsageError
from fsdp_plugin.checkpoint.errors import CheckpointStateError

_STATE_DICT_TYPES = ("sharded", "full")
_ACCUMULATION = ("sharded", "no_sync")


class FSDPPluginStrategy(common.ProcessPerDevice, ParallelStrategy):
    """Fully sharded data parallel training on the fsdp_plugin engine.

    Args:
        state_dict_type: ``"sharded"`` (default): checkpoints are engine directories, loadable at any world
            size; ``"full"``: one file in Lightning's torch format (``MyModule.load_from_checkpoint(path)``
            and ``torch.load(path, weights_only=True)`` read it) with the plain model weights and Lightning's
            state, without per-parameter optimizer state.
        accumulate_grads: ``"sharded"`` (default): during ``accumulate_grad_batches`` every micro-batch
            reduce-scatters into the sharded gradient (memory of one shard); ``"no_sync"``: keep full
            unsharded gradients locally and communicate once per optimizer step (``fp.no_sync``).
        process_group_backend: default ``gloo`` on CPU, ``nccl`` on CUDA.
        timeout: process group timeout.
        log_comm_stats: log ``fp.comm_stats`` on the optimizer steps whose metrics Lightning sends to the logger
            (the Trainer's ``log_every_n_steps``; ``self.log``, on step): metrics ``fsdp_plugin/comm_bytes/<kind>``
            (per-rank ring bytes) and ``fsdp_plugin/comm_calls/<kind>``, e.g. ``all_gather``, ``reduce_scatter``:
            the mean per optimizer step since the previous logged one.
        **sharding: ``fp.ShardingConfig`` fields (``sharding_strategy``, ``auto_wrap_policy``,
            ``mixed_precision``, ``activation_checkpointing``, ``cpu_offload``, ...), or Lightning
            ``FSDPStrategy``'s spellings of them (torch enums, ``MixedPrecision``, ``ModuleWrapPolicy``,
            ``activation_checkpointing_policy``, ...: see ``_fsdp_kwargs``). An explicit ``mixed_precision``
            overrides the one derived from the Trainer's ``precision`` flag.
        async_save: ``True`` / ``"deferred"``: sharded saves return after the host snapshot and write in the
            background (``fp.save_checkpoint(async_save=...)``); Lightning's ``AsyncCheckpointIO`` plugin
            selects ``True``. The pending save is waited for by the next save/load and by teardown.
        data_parallel_size, tensor_parallel_size: Lightning ``ModelParallelStrategy``'s 2-D mesh (either given;
            ``"auto"``: nodes, devices per node): ``self.device_mesh`` with dims ``("data_parallel",
            "tensor_parallel")``; the LightningModule's ``configure_model`` parallelizes on
            ``self.device_mesh["tensor_parallel"]`` (no ``fully_shard``), the strategy shards over
            ``"data_parallel"`` and samples data per dp rank. ``configure_model`` then runs eagerly (no deferred
            init). See ``_tensor_parallel``.
    """

    #: ``torch.compile``d LightningModules are compiled per unit (see ``_compile``), not refused.
    compiles_per_unit = True

    _launcher_cls = _SubprocessScriptLauncher

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        accumulate_grads: Literal["sharded", "no_sync"] = "sharded",
        log_comm_stats: bool = True,
        async_save: bool | Literal["deferred"] = False,
        data_parallel_size: tp2d.Size = None,
        tensor_parallel_size: tp2d.Size = None,
        **sharding: Any,
    ) -> None:
        _check_choice("state_dict_type", state_dict_type, _STATE_DICT_TYPES)
        _check_choice("accumulate_grads", accumulate_grads, _ACCUMULATION)
        if async_save not in (False, True, "deferred"):
            raise ValueError(f"FSDPPluginStrategy(async_save={async_save!r}): use False, True or 'deferred'")
        self.sharding_config = common.sharding_config(sharding)  # eager validation
        tp2d.refuse_context_parallel(data_parallel_size, tensor_parallel_size, self.sharding_config.context_parallel)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.state_dict_type = state_dict_type
        self.accumulate_grads = accumulate_grads
        self.log_comm_stats = log_comm_stats
        self._comm_seen: dict[str, dict[str, int]] = {}
        self._comm_steps = 0  # optimizer steps since _comm_seen
        self._async_save = async_save
        self._2d_sizes = (data_parallel_size, tensor_parallel_size)
        self._device_mesh = None
        _compile.allow_in_trainer()
        self.num_nodes = 1

    # ----------------------------------------------------------------- registry and plumbing
    @property
    def precision_plugin(self) -> Any:
        return self._precision_plugin if self._precision_plugin is not None else FSDPPluginPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = common.convert_precision(plugin, FSDPPluginPrecision)

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def async_saves(self) -> int:
        """Asynchronous checkpoint saves this strategy started."""
        return pending_save.of(self).started

    def setup_environment(self) -> None:
        super().setup_environment()
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        self._init_process_group()
        if tp2d.requested(*self._2d_sizes):
            dp, tp = tp2d.resolve(*self._2d_sizes, self.num_nodes, self.num_processes)
            self._device_mesh = tp2d.build_mesh(dp, tp, self.root_device)
            assert self.lightning_module is not None
            self.lightning_module._device_mesh = self._device_mesh   # configure_model reads self.device_mesh

    @property
    def device_mesh(self) -> Any:
        """The ``("data_parallel", "tensor_parallel")`` DeviceMesh (``data_parallel_size``/``tensor_parallel_size``)."""
        if self._device_mesh is None:
            raise UsageError("FSDPPluginStrategy.device_mesh exists with data_parallel_size/tensor_parallel_size, "
                             "once the processes are initialized")
        return self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        if self._device_mesh is not None:
            return tp2d.sampler_kwargs(self._device_mesh)
        return super().distributed_sampler_kwargs

    # ----------------------------------------------------------------- model construction and sharding
    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``empty_init=True`` (``trainer.init_module(empty_init=True)``): build under ``fp.deferred_init()`` (not
        in the 2-D mode: the model is parallelized before fp.shard)."""
        deferred = bool(empty_init) and not tp2d.requested(*self._2d_sizes)
        with common.deferred_init_context(deferred), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` runs under ``fp.deferred_init()``; ``setup`` materializes it sharded. In the 2-D
        mode it runs eagerly: it parallelizes real modules on ``self.device_mesh["tensor_parallel"]``."""
        with common.deferred_init_context(not tp2d.requested(*self._2d_sizes)):
            yield

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if not fp.is_sharded(self.model):
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self.model = self.precision_plugin.convert_module(self.model)
            cfg = common.with_precision(self.sharding_config, self.precision_plugin)
            if self._device_mesh is not None:    # the user's configure_model parallelized on "tensor_parallel"
                tp2d.check_configured(self.lightning_module)
                tp2d.check_parallelized(self.model, self._device_mesh["tensor_parallel"].size())
                cfg = dataclasses.replace(cfg, device_mesh=self._device_mesh["data_parallel"])
            dynamo_ctx = _compile.take(self.lightning_module)  # Trainer.fit(torch.compile(model))
            self.model = common.shard_module(self.model, cfg, self.root_device)
            _compile.apply(self.model, dynamo_ctx)
        self.barrier()
        self._comm_seen, self._comm_steps = fp.comm_stats.snapshot(), 0
        _uneven_eval.install(trainer)     # validation/test batches that differ per rank: fp.join
        if trainer.state.fn == TrainerFn.FITTING:
            _uneven.install(trainer)
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)  # built from the sharded parameters
        self.setup_precision_plugin()

    def model_to_device(self) -> None:
        """The engine places the shards; nothing to move."""

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Accumulation steps: sharded reduce-scatter each micro-batch, or ``fp.no_sync`` when asked."""
        context = fp.no_sync(self.model) if self.accumulate_grads == "no_sync" else nullcontext()
        with context, _uneven.accumulating(self.model):
            yield None

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.log_comm_stats:
            self._comm_steps += 1
            self._log_comm_stats()
        return out

    def _log_comm_stats(self) -> None:
        """On a step whose metrics reach the logger: bytes and calls per collective kind, mean per optimizer
        step since the previous logged step, as on-step metrics (other steps only count)."""
        module = self.lightning_module
        if module is None or module._trainer is None or not _logs_this_step(module._trainer):
            return
        now, steps = fp.comm_stats.snapshot(), max(self._comm_steps, 1)
        before, self._comm_seen, self._comm_steps = self._comm_seen, now, 0
        metrics = {f"fsdp_plugin/comm_{what}/{kind}": (n - before.get(what, {}).get(kind, 0)) / steps
                   for what in ("bytes", "calls") for kind, n in now[what].items()}
        module.log_dict(metrics, on_step=True, on_epoch=False)

    # ----------------------------------------------------------------- collectives
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():  # fsdp_plugin's barrier: the config's timeout_s, CollectiveError
            common.barrier(self.sharding_config, name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        return common.broadcast(self.sharding_config, obj, src)  # JSON through fsdp_plugin's collectives, no pickle

    def reduce(self, tensor: Tensor | Any, group: Any | None = None,
               reduce_op: Any | str | None = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return common.reduce(self.sharding_config, tensor, group, reduce_op) if _distributed_is_initialized() \
                else tensor
        return tensor

    # ----------------------------------------------------------------- checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Model state is written by the engine in ``save_checkpoint``; nothing to gather here."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Tensor]:
        """Optimizer state is written by the engine in ``save_checkpoint``; nothing to gather here."""
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Collective. ``sharded``: an engine directory at ``filepath``; ``full``: one Lightning-format file."""
        if storage_options is not None:
            raise UsageError(f"{type(self).__name__}.save_checkpoint does not take storage_options (they are for "
                            "CheckpointIO plugins, which this strategy does not use).")
        meta, with_optimizers = ckpt.split_state(checkpoint)
        if self.state_dict_type == "full" and with_optimizers:
            meta[ckpt.PARAM_GROUPS_KEY] = ckpt.param_group_hypers(self.optimizers)
        encoded = ckpt.encode_meta(meta)  # every rank, before any collective: a bad value fails everywhere
        path = ckpt.as_path(self.broadcast(str(filepath)))
        assert self.model is not None
        if self.state_dict_type == "full":
            ckpt.save_full(path, self.model, meta, encoded)
        else:
            optimizers, mode = self.optimizers if with_optimizers else [], _async_save.requested(self)
            pending_save.of(self).start(lambda: ckpt.save_sharded(path, self.model, optimizers, encoded, mode))

    def remove_checkpoint(self, filepath: Any) -> None:
        """``ModelCheckpoint``'s rotation (``save_top_k``, keep-last-k): after the save that evicts ``filepath`` is
        published (Lightning calls this right after starting it, which may still run in the background), rank 0
        removes it, an engine checkpoint's manifest first (see ``fsdp_plugin.checkpoint.storage.remove_checkpoint``)."""
        pending_save.of(self).defer(lambda: self._remove_now(filepath))

    def _remove_now(self, filepath: Any) -> None:
        path = ckpt.as_path(str(filepath))
        if not self.is_global_zero:
            return
        if ckpt.is_sharded_checkpoint(path):
            storage.remove_checkpoint(str(path))
        else:
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Collective. Loads model (+ optimizers when fitting) in place; returns Lightning's other state."""
        pending_save.of(self).wait()  # the checkpoint being loaded may still be written
        path = ckpt.as_path(self.broadcast(str(checkpoint_path)))
        kind = ckpt.checkpoint_kind(path)
        assert self.model is not None and self.lightning_module is not None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if kind is None and stock_ckpt.is_stock_sharded(path):  # from Lightning's own FSDPStrategy (torch DCP)
            return stock_ckpt.load_stock(path, self.model, self.optimizers if fitting else [])
        if kind is None:
            raise CheckpointStateError(f"{path} is not an fsdp_plugin Lightning checkpoint: give a checkpoint directory "
                                       "(with manifest.json, state_dict_type='sharded') or a 'full' checkpoint file.")
        if kind == "sharded":
            return ckpt.load_sharded(path, self.model, self.optimizers if fitting else [])
        meta = ckpt.load_full(path, self.model)
        groups = meta.pop(ckpt.PARAM_GROUPS_KEY, None)
        if fitting and self.optimizers:
            rank_zero_warn(f"{path} is a 'full' checkpoint: it holds the optimizers' hyper-parameters (lr, ...) but "
                           "not their per-parameter state (e.g. Adam moments), which restarts from zero.")
            ckpt.apply_param_group_hypers(self.optimizers, groups)
        return meta

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Already loaded by ``load_checkpoint``."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Already loaded by ``load_checkpoint``."""

    def teardown(self) -> None:
        """Like FSDPStrategy, but no ``.cpu()`` and no SyncBatchNorm revert: the model stays sharded in place
        (reverting would replace modules whose parameters the engine owns)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        pending_save.of(self).wait()  # before the process group goes away
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()


def _logs_this_step(trainer: Any) -> bool:
    """Whether Lightning sends this training step's on-step metrics to the logger (``log_every_n_steps``)."""
    connector = getattr(trainer, "_logger_connector", None)
    if connector is not None and hasattr(connector, "should_update_logs"):
        return bool(connector.should_update_logs)
    every = getattr(trainer, "log_every_n_steps", 1)  # a Lightning without the connector property
    return bool(every) and (trainer.global_step % every == 0)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"FSDPPluginStrategy({name}={value!r}): use one of {', '.join(repr(c) for c in choices)}")
