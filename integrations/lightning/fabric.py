"""``FSDPPluginFabricStrategy``: ``Fabric(strategy="fsdp_plugin")`` on the fsdp_plugin engine.

Shares config, process group, sharding, precision and codec with the Trainer strategy. ``setup`` shards the
module in place (parameters keep their identity, so optimizers made before or after ``setup`` both work);
``no_backward_sync`` is ``fp.no_sync``; ``clip_gradients`` uses ``fp.clip_grad_norm_``; ``save``/``load``
write/read the engine's sharded directory (loadable at any world size), the non-tensor state going through
the pickle-free codec.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from fsdp_plugin.integrations.lightning.checkpoint import io as ckpt
from typing import Any

import torch
from fsdp_plugin.integrations.lightning import _plumbing as common
from fsdp_plugin.integrations.lightning.checkpoint import fabric_state as fstate
from fsdp_plugin.integrations.lightning.precision import FSDPPluginFabricPrecision
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _Sharded
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
)
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

import fsdp_plugin as fp
from fsdp_plugin.errors import UnsupportedError, UsageError


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(module)`` → ``fp.no_sync(module)``."""

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return fp.no_sync(module) if enabled else nullcontext()


class FSDPPluginFabricStrategy(common.ProcessPerDevice, ParallelStrategy, _Sharded):
    """Fully sharded data parallel Fabric strategy.

    Keyword arguments: the ``fp.ShardingConfig`` fields, or Fabric ``FSDPStrategy``'s spellings of them (see
    ``_fsdp_kwargs``). ``state_dict_type`` is ``"sharded"`` (Fabric's default; ``"full"`` is refused:
    ``fabric.save`` writes a sharded directory, which ``fsdp-plugin consolidate`` exports).
    """

    _launcher_cls = _SubprocessScriptLauncher

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        state_dict_type: str = "sharded",
        **sharding: Any,
    ) -> None:
        if state_dict_type != "sharded":
            raise fp.ConfigError(f"FSDPPluginFabricStrategy(state_dict_type={state_dict_type!r}): fabric.save writes "
                                 "a sharded directory (loadable at any world size); export it with `fsdp-plugin "
                                 "consolidate CKPT OUT` (or get the weights with fp.full_state_dict(module))")
        self.sharding_config = common.sharding_config(sharding)
        from fsdp_plugin.integrations.lightning import _compile

        _compile.compile_in_fabric()  # fabric.setup(torch.compile(model)) compiles per unit
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision=precision)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._backward_sync_control = _NoSync()

    # ----------------------------------------------------------------- plumbing
    @property
    def precision(self) -> Any:
        return self._precision if self._precision is not None else FSDPPluginFabricPrecision()

    @precision.setter
    def precision(self, precision: Any) -> None:
        self._precision = common.convert_precision(precision, FSDPPluginFabricPrecision)

    @property
    def checkpoint_io(self) -> Any:
        raise UnsupportedError(f"{type(self).__name__} saves through the fsdp_plugin engine, not CheckpointIO")

    @checkpoint_io.setter
    def checkpoint_io(self, io: Any) -> None:
        if io is not None:
            raise UnsupportedError(f"{type(self).__name__} does not use CheckpointIO plugins")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        self._init_process_group()

    # ----------------------------------------------------------------- modules
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """``fabric.init_module(empty_init=True)``: build under ``fp.deferred_init()`` (materialized in setup)."""
        stack = ExitStack()
        stack.enter_context(common.deferred_init_context(bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_sharded_context(self) -> AbstractContextManager:
        return common.deferred_init_context(True)

    def setup_module(self, module: Module) -> Module:
        module = self.precision.convert_module(module) if not fp.is_sharded(module) else module
        cfg = common.with_precision(self.sharding_config, self.precision)
        return common.shard_module(module, cfg, self.root_device)

    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Module, list[Optimizer], Any]:
        """Parameters keep their identity through sharding: optimizers need no rebuilding."""
        return self.setup_module(module), optimizers, scheduler

    def module_to_device(self, module: Module) -> None:
        """The engine places the shards."""

    def clip_gradients_norm(self, module: Module, optimizer: Optimizer, max_norm: float,
                            norm_type: float = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        return self.precision.clip_norm(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite)

    # ----------------------------------------------------------------- collectives
    def all_reduce(self, tensor: Tensor, group: Any | None = None,
                   reduce_op: Any | str | None = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return common.reduce(self.sharding_config, tensor, group, reduce_op) if _distributed_is_initialized() \
                else tensor
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():  # fsdp_plugin's barrier: the config's timeout_s, CollectiveError
            common.barrier(self.sharding_config, args[0] if args else kwargs.get("name"))

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        return common.broadcast(self.sharding_config, obj, src)  # JSON through fsdp_plugin's collectives, no pickle

    # ----------------------------------------------------------------- checkpoints
    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Collective: the engine's sharded directory at ``path`` (one module, its optimizer(s), other state)."""
        if storage_options is not None or filter:
            raise UsageError(f"{type(self).__name__}.save_checkpoint takes neither storage_options nor filter")
        fstate.save(lambda: ckpt.as_path(self.broadcast(str(path))), state)

    def load_checkpoint(self, path: Any, state: Any | None = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Collective: restores modules/optimizers/stateful objects in ``state`` in place; returns the rest."""
        return fstate.load(ckpt.as_path(self.broadcast(str(path))), state, strict)
