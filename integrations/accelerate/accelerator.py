"""``Accelerator``: a drop-in ``accelerate.Accelerator`` whose FSDP runs on fsdp_plugin's engine.

Select FSDP as usual (``accelerate launch`` with ``distributed_type: FSDP`` and ``fsdp_config:``,
or ``fsdp_plugin=FullyShardedDataParallelPlugin(...)``), or pass ``sharding_config=fp.ShardingConfig``.
The accelerate settings are translated into an ``fp.ShardingConfig`` (see ``from_env``,
``from_plugin``, ``resolve``); stock accelerate never sees them, so it builds neither torch FSDP nor
DDP. Without an FSDP selection this class behaves exactly like ``accelerate.Accelerator``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import warnings
from types import MethodType
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.utils import DistributedType

from fsdp_plugin.checkpoint.storage import is_url
from fsdp_plugin.integrations import _pending_save as pending_save

from . import tensor_parallel
from .state import dirs as state_dirs
from .state import io as state_io
from .env import hidden_env, needs_cpu_flag
from .config.parse import parse_mixed_precision
from .config.resolve import sharding_config as resolve_config
from .config.selection import check_precision_flag, select_settings
from .config.settings import FsdpSettings
from fsdp_plugin.errors import ShardingError

_PARENT_SIGNATURE = inspect.signature(accelerate.Accelerator.__init__)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` with FSDP provided by ``fsdp_plugin``.

    Extra keyword: ``sharding_config`` (an ``fp.ShardingConfig``) configures the engine in code and
    takes precedence over any accelerate FSDP setting.
    """

    def __init__(self, *args: Any, sharding_config: Any = None, **kwargs: Any):
        bound = _PARENT_SIGNATURE.bind(None, *args, **kwargs).arguments
        bound.pop("self", None)
        plugin_given = bound.get("fsdp_plugin") is not None
        settings = select_settings(bound, sharding_config)
        self._fp_settings: FsdpSettings | None = settings
        self._fp_user_config = sharding_config
        self._fp_active = False
        if settings is None and sharding_config is None:
            super().__init__(**bound)
            return
        check_precision_flag(bound.get("mixed_precision"))
        if needs_cpu_flag():
            bound["cpu"] = True
        # stock accelerate validates a ParallelismConfig in __init__ and takes only FSDP2 or a multi-device type
        # (a CPU world is MULTI_CPU): our engine is the FSDP it checks for, so the check sees a multi-device run
        self._fp_validating = bound.get("parallelism_config") is not None
        try:
            with hidden_env():
                super().__init__(**bound)
        finally:
            self._fp_validating = False
        self._finish_init(plugin_given=plugin_given)

    # ------------------------------------------------------------------ setup
    def _finish_init(self, plugin_given: bool) -> None:
        """Adopt the resolved precision, check the world, swap in a sharding-aware scaler."""
        if self._fp_settings is not None:
            self._fp_settings.mixed_precision = parse_mixed_precision(self.state.mixed_precision, "mixed_precision")
        if plugin_given:
            os.environ["ACCELERATE_USE_FSDP"] = "true"  # transformers' low-RAM loading reads it
        if self._fp_settings is not None and self._fp_settings.cpu_ram_efficient_loading:
            _enable_ram_efficient_loading()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.num_processes:
            raise ShardingError(f"accelerate sees {self.num_processes} process(es) but the process group has "
                               f"{dist.get_world_size()}: launch with `accelerate launch` (or torchrun) and the "
                               "same process count")
        if self.scaler is not None:  # fp16: every rank must agree on skipping a step (sharded grads)
            import fsdp_plugin as fp

            kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            self.scaler = fp.GradScaler(self.device.type, **kwargs)
        self.sharding_configs: list = []
        self._fp_dp_mesh = None                 # tensor parallelism: the dp dims of accelerate's mesh
        self._fp_tp_mesh = None
        if self._fp_settings is not None and self._fp_settings.tensor_parallel:
            if self.context_parallel > 1:           # cp x tp: the engine's (dp.., cp) mesh (issue 54)
                self._fp_dp_mesh, self._fp_tp_mesh = tensor_parallel.cp_meshes(self.parallelism_config,
                                                                                self.device.type)
            else:
                self._fp_dp_mesh = tensor_parallel.dp_mesh(self.parallelism_config, self.torch_device_mesh)
                self._fp_tp_mesh = self.torch_device_mesh["tp"]
        self._fp_active = True

    @property
    def distributed_type(self):
        """Reports ``DistributedType.FSDP`` when our engine shards (``self.state`` keeps the truth)."""
        if getattr(self, "_fp_active", False):
            return DistributedType.FSDP
        return self.state.distributed_type

    @property
    def multi_device(self):
        """True inside :meth:`join_uneven_inputs` too, so accelerate's own implementation runs for sharded models,
        and while stock ``__init__`` validates a ``ParallelismConfig`` (it accepts FSDP2 or multi-device types)."""
        return getattr(self, "_fp_joining", False) or getattr(self, "_fp_validating", False) or super().multi_device

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches=None):
        """accelerate's ``join_uneven_inputs`` (torch's ``Join``; ``even_batches`` override of the data loaders)
        for sharded models, which fp.shard makes joinables: a rank out of batches shadows the others' steps.
        Stock accelerate skips it for FSDP (``multi_device`` is False); the override makes it run."""
        self._fp_joining = self._fp_active and self.num_processes > 1
        try:
            with super().join_uneven_inputs(joinables, even_batches) as ctx:
                self._fp_joining = False          # read once, when the context is entered
                yield ctx
        finally:
            self._fp_joining = False

    @property
    def comm_stats(self):
        """``fp.comm_stats``: collective calls and per-rank bytes by kind since the last ``reset()``."""
        import fsdp_plugin as fp

        return fp.comm_stats

    @property
    def pending_checkpoint(self):
        """The ``fp.AsyncSave`` of the last ``save_state(async_save=...)`` while it may still be written, else
        None; the next ``save_state``/``load_state`` and ``end_training`` wait for it."""
        return pending_save.of(self).handle

    @property
    def fsdp_settings(self) -> FsdpSettings | None:
        """The translated accelerate FSDP settings (None when configured by ``sharding_config``)."""
        return self._fp_settings

    def sharding_config_for(self, model: torch.nn.Module):
        """The ``fp.ShardingConfig`` used for ``model``."""
        if self._fp_user_config is not None:
            return self._fp_user_config
        cfg = resolve_config(self._fp_settings, model, device=self.device)
        if self._fp_dp_mesh is not None:
            cfg = dataclasses.replace(cfg, device_mesh=self._fp_dp_mesh)
        return cfg

    @property
    def context_parallel(self) -> int:
        """``fp.ShardingConfig.context_parallel`` of this run (``ParallelismConfig(cp_size=...)``, the launcher's
        ``parallelism_config_cp_size``, or ``sharding_config=``); 1 when off."""
        cfg = self._fp_user_config if getattr(self, "_fp_user_config", None) is not None else self._fp_settings
        return getattr(cfg, "context_parallel", 1) or 1

    @property
    def num_processes(self):
        """The world, except while a data loader is prepared under context parallel: the data-parallel size."""
        return super().num_processes // getattr(self, "_fp_dp_view", 1)

    @property
    def process_index(self):
        return super().process_index // getattr(self, "_fp_dp_view", 1)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        """Under context parallel the C ranks of a CP group must read the same batches (the engine splits each
        sequence among them): the loader is sharded over the data-parallel ranks (``fp.data_parallel_rank``)."""
        self._fp_dp_view = self.context_parallel if getattr(self, "_fp_active", False) else 1
        if getattr(self, "_fp_tp_mesh", None) is not None:
            self._fp_dp_view = 1    # tensor parallel: stock accelerate splits by its mesh's dp rank (cp and tp out)
        try:
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        finally:
            self._fp_dp_view = 1

    # ---------------------------------------------------------------- prepare
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        """Shard ``model`` in place with fsdp_plugin (no DDP/FSDP wrapper); parameters keep identity,
        so optimizers built before ``prepare`` stay valid."""
        if not self._fp_active:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if getattr(model, "_is_accelerate_prepared", False):
            if model not in self._models:
                self._models.append(model)
            return model
        self._models.append(model)
        self._shard(model)
        if self.native_amp:
            _wrap_forward_in_autocast(model, self.native_amp, self.autocast_handler)
        if self.state.dynamo_plugin.backend != accelerate.utils.DynamoBackend.NO:
            import fsdp_plugin as fp

            # per unit, hooks outside the compiled regions (what accelerate's regional compilation does for
            # repeated blocks); a whole-model torch.compile would trace the engine's collectives
            fp.compile(model, **self.state.dynamo_plugin.to_kwargs())
        model._is_accelerate_prepared = True
        return model

    def _shard(self, model: torch.nn.Module) -> None:
        """``fp.shard`` unless the model is already sharded."""
        import fsdp_plugin as fp

        if fp.is_sharded(model):
            return
        before = dict(model.named_parameters(remove_duplicate=False))
        if self._fp_dp_mesh is not None:
            tensor_parallel.parallelize(model, self._fp_tp_mesh)
        cfg = self.sharding_config_for(model)
        self.sharding_configs.append(cfg)
        fp.shard(model, cfg)
        tensor_parallel.remap_optimizers(self._optimizers, before, model)

    def _get_parameters_to_remap(self, *args, **kwargs):
        """accelerate >= 1.16's ``prepare()`` records, for FSDP, the parameters that torch FSDP1's init may replace
        (reading ``state.fsdp_plugin``, which our runs never set) so that it can point optimizers at the new ones
        afterwards. ``fp.shard`` keeps every Parameter object (tensor parallelism remaps in ``_shard``): nothing
        to remap. Never called by accelerate < 1.16."""
        if getattr(self, "_fp_active", False):
            return {}
        return super()._get_parameters_to_remap(*args, **kwargs)

    def _prepare_tp(self, *args):
        """Stock accelerate's TP preparation (DTensor-replicating the plain parameters for FSDP2, remapping
        optimizers by storage address) is replaced by ``_shard``'s: here only the data loaders, optimizers
        and schedulers are prepared, as stock's first passes do."""
        if not self._fp_active:
            return super()._prepare_tp(*args)
        first = [a if isinstance(a, torch.nn.Module) else self._prepare_one(a, first_pass=True) for a in args]
        return [a if isinstance(a, torch.nn.Module) else self._prepare_one(a) for a in first]

    def _prepare_cp(self, *args):
        """cp x tp keeps the ParallelismConfig for stock accelerate, whose ``_prepare_cp`` would hook torch's own
        context parallel (SDPA only, torch FSDP2) onto the model: our engine splits the sequence itself."""
        if not self._fp_active:
            return super()._prepare_cp(*args)
        return args

    @contextlib.contextmanager
    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """Nothing to enter under our engine: every rank of a CP group passes the full batch and ``fp.shard``'s
        context parallel splits it (stock accelerate's version would shard ``buffers`` in place)."""
        if not self._fp_active:
            with super().maybe_context_parallel(buffers, buffer_seq_dims, no_restore_buffers):
                yield
            return
        yield

    # ------------------------------------------------------- training helpers
    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module):
        """Accumulate gradients locally (no reduce-scatter) inside the block."""
        if not self._fp_active:
            with super().no_sync(model):
                yield
            return
        import fsdp_plugin as fp

        with fp.no_sync(model):
            yield

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        """Clip by the exact global norm over all shards; returns it (same value on every rank)."""
        if not self._fp_active:
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        import fsdp_plugin as fp

        self.unscale_gradients()
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return fp.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value: float):
        """Elementwise clipping, exact on shards."""
        if not self._fp_active:
            return super().clip_grad_value_(parameters, clip_value)
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ------------------------------------------------------------ state dicts
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True):
        """Collective: the full (plain-model) state dict on rank 0, ``{}`` on other ranks."""
        if not self._fp_active:
            return super().get_state_dict(model, unwrap=unwrap)
        import fsdp_plugin as fp

        if unwrap:
            model = self.unwrap_model(model)
        return fp.full_state_dict(model)

    def save_model(self, model: torch.nn.Module, save_directory, max_shard_size="10GB",
                   safe_serialization: bool = True):
        """Collective: stock accelerate's ``save_model`` files (safetensors + index when split by
        ``max_shard_size``), byte for byte, with every rank writing its own byte ranges (no gather)."""
        if not self._fp_active:
            return super().save_model(model, save_directory, max_shard_size=max_shard_size,
                                      safe_serialization=safe_serialization)
        if not safe_serialization:
            warnings.warn("save_model: fsdp_plugin always writes safetensors (safe_serialization=False ignored)",
                          stacklevel=2)
        from fsdp_plugin.integrations._ranged_save import save_like_library

        model = self.unwrap_model(model)

        def stock(state_dict):  # accelerate's own writer, given the stand-ins as the model's state dict
            self.get_state_dict = lambda *_a, **_k: state_dict
            try:
                return accelerate.Accelerator.save_model(self, model, save_directory, max_shard_size=max_shard_size,
                                                         safe_serialization=True)
            finally:
                del self.get_state_dict

        save_like_library(model, stock, "save_model")

    def end_training(self) -> None:
        """accelerate's ``end_training`` with fsdp_plugin's clean shutdown: every rank arrives (a barrier with
        a deadline), then the process groups are destroyed and their threads joined before Python exits."""
        from fsdp_plugin import shutdown

        pending_save.of(self).wait()  # its background collectives need the process groups that shutdown destroys
        if not getattr(self.state, "fork_launched", False):
            shutdown()
        super().end_training()  # trackers; its destroy_process_group is a no-op now

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, async_save=False,
                   **kwargs):
        """Collective: models + optimizers in fsdp_plugin's sharded format, the rest as JSON/safetensors.

        With ``fsdp_state_dict_type: FULL_STATE_DICT`` each model's full weights are also written as
        Hugging Face safetensors in ``full_model_<i>/``; ``load_state`` always resumes from the sharded
        state (it holds the optimizer too, and loads at any process count).
        ``async_save=True`` / ``"deferred"`` (see ``fp.save_checkpoint``): the last model's checkpoint is
        written in the background; ``self.pending_checkpoint`` is its ``fp.AsyncSave`` handle, waited for by
        the next ``save_state``/``load_state`` and at exit.
        """
        if not self._fp_active:
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        pending_save.of(self).wait()  # before old checkpoint directories are rotated away
        output_dir = state_dirs.output_dir(self, output_dir)
        if not is_url(output_dir):  # an object store has no directories to create
            os.makedirs(output_dir, exist_ok=True)
        self.wait_for_everyone()
        for hook in self._save_model_state_pre_hook.values():
            hook(self._models, [], output_dir)
        pending_save.of(self).start(
            lambda: state_io.save_models(output_dir, self._models, self._optimizers, async_save))
        if self._fp_settings is not None and self._fp_settings.state_dict_type == "full":
            state_io.save_full_models(output_dir, self._models)
        state_io.save_small_state(output_dir, self)
        self.wait_for_everyone()
        self.project_configuration.iteration += 1
        return output_dir

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs):
        """Collective: inverse of :meth:`save_state`, at any process count."""
        if not self._fp_active:
            return super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)
        pending_save.of(self).wait()  # the state being loaded may still be written
        input_dir = state_dirs.input_dir(self, input_dir)
        for hook in self._load_model_state_pre_hook.values():
            hook(self._models, input_dir)
        from .state import stock
        if stock.is_stock_sharded(input_dir):  # resuming a stock accelerate FSDP run (torch DCP inside)
            stock.load_stock(input_dir, self, self._models, self._optimizers)
        else:
            state_io.load_models(input_dir, self._models, self._optimizers)
            state_io.load_small_state(input_dir, self)
        self.wait_for_everyone()


def _enable_ram_efficient_loading() -> None:
    """``fsdp_cpu_ram_efficient_loading``: later ``from_pretrained`` calls read weights on rank 0 only
    (the others build on meta and get rank 0's values when prepared); see ``integrations/_hf_loading``.
    Only ``from_pretrained`` is patched: the transformers ``Trainer`` stays stock unless its integration is
    imported."""
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
    try:
        from fsdp_plugin.integrations import _hf_loading

        _hf_loading.install()
    except ImportError:  # no transformers: nothing loads pretrained weights through it
        pass


def _wrap_forward_in_autocast(model: torch.nn.Module, native_amp: bool, handler: Any) -> None:
    """What stock accelerate does for native AMP: autocast forward, outputs back to fp32."""
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    model._original_forward = model.forward
    autocast_context = get_mixed_precision_context_manager(native_amp, handler)
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(convert_outputs_to_fp32(autocast_context(model.forward.__func__)), model)
    else:
        model.forward = convert_outputs_to_fp32(autocast_context(model.forward))
