"""Pieces shared by the Trainer and Fabric strategies: config, process plumbing, sharding, precision plugins."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from fsdp_plugin.integrations.lightning._fsdp_kwargs import translate as translate_fsdp_kwargs
from fsdp_plugin.integrations.lightning._precision_map import unsupported_message
from fsdp_plugin.integrations.lightning.precision import _PrecisionCore, flag_of
from lightning.fabric.plugins.precision import HalfPrecision as FabricHalf
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixed
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

import fsdp_plugin as fp
from fsdp_plugin.errors import UsageError

FORWARD_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_CONVERTIBLE = (Precision, MixedPrecision, HalfPrecision, FabricPrecision, FabricMixed, FabricHalf)


class ProcessPerDevice:
    """Plumbing the Trainer and Fabric strategies share: one process per device, global ranks node-major.

    Mixed in before Lightning's ``ParallelStrategy``; the subclass sets ``_launcher_cls`` (the Trainer's or
    Fabric's own subprocess launcher) and, in ``__init__``, ``sharding_config``, ``_process_group_backend`` and
    ``_timeout``."""

    _launcher_cls: type

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # context_parallel=C: the C consecutive ranks of a CP group read the same samples (fp.data_parallel_rank)
        cp = getattr(getattr(self, "sharding_config", None), "context_parallel", 1)
        return {"num_replicas": self.num_nodes * self.num_processes // cp, "rank": self.global_rank // cp}

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self._launcher_cls(self.cluster_environment, self.num_processes, self.num_nodes)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        utils_rank_zero_only.rank = self.global_rank

    def _init_process_group(self) -> None:
        assert self.cluster_environment is not None
        self._process_group_backend = init_process_group(
            self.cluster_environment, self.root_device, self._process_group_backend, self._timeout,
            bool(getattr(self.sharding_config, "cpu_offload", False)))


def sharding_config(kwargs: dict[str, Any]) -> Any:
    """Build and validate ``fp.ShardingConfig`` from strategy kwargs (ours, or Lightning ``FSDPStrategy``'s
    translated by ``_fsdp_kwargs``); unknown keys name the valid fields."""
    kwargs = translate_fsdp_kwargs(kwargs)
    two_d = sorted({"data_parallel_size", "tensor_parallel_size"} & set(kwargs))
    if two_d:       # the Trainer strategy takes them as its own arguments (_tensor_parallel.py); Fabric's does not
        raise fp.UnsupportedError(
            f"FSDPPluginFabricStrategy({', '.join(two_d)}=...): ModelParallelStrategy's 2-D mesh is supported by the "
            "Trainer strategy (FSDPPluginStrategy(data_parallel_size=..., tensor_parallel_size=...)), not by Fabric's "
            "yet. In Fabric build mesh = init_device_mesh(device, (dp, tp), mesh_dim_names=('data_parallel', "
            "'tensor_parallel')), parallelize_module(model, mesh['tensor_parallel'], plan) and "
            "fp.shard(model, device_mesh=mesh['data_parallel']) (README \"Tensor parallel\")")
    valid = [f.name for f in dataclasses.fields(fp.ShardingConfig)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise UsageError(
            f"FSDPPluginStrategy got unknown argument(s) {unknown}. It accepts the fp.ShardingConfig fields "
            f"{valid}, Lightning FSDPStrategy's activation_checkpointing_policy, use_orig_params and "
            "sync_module_states, plus state_dict_type, process_group_backend and timeout."
        )
    return fp.ShardingConfig(**kwargs)


def with_precision(cfg: Any, plugin: Any) -> Any:
    """Fill ``cfg.mixed_precision`` from the precision flag unless the user set it explicitly."""
    if getattr(cfg, "mixed_precision", None) is not None or not isinstance(plugin, _PrecisionCore):
        return cfg
    policy = plugin.mixed_precision()
    if policy is None:
        return cfg
    if dataclasses.is_dataclass(cfg):
        return dataclasses.replace(cfg, mixed_precision=policy)
    cfg.mixed_precision = policy
    return cfg


def convert_precision(plugin: Any | None, plugin_cls: type) -> Any | None:
    """Replace a plugin built by Lightning's connector with ``plugin_cls`` for the same flag; refuse others."""
    if plugin is None or isinstance(plugin, _PrecisionCore):
        return plugin
    if type(plugin) not in _CONVERTIBLE:
        flag = getattr(plugin, "precision", None)
        raise UsageError(unsupported_message(f"{type(plugin).__name__}({flag!r})", source="precision plugin"))
    return plugin_cls(flag_of(plugin), device_type=getattr(plugin, "device", "cpu"))


def init_process_group(
    env: Any, root_device: torch.device, backend: str | None, timeout: Any, cpu_offload: bool
) -> str:
    """Create the default process group (a no-op if one exists); return the backend used."""
    if backend is None:
        backend = _get_default_process_group_backend_for_device(root_device)
        if cpu_offload and backend == "nccl":
            backend = "cuda:nccl,cpu:gloo"
    kwargs: dict[str, Any] = {"timeout": timeout}
    if root_device.type != "cpu":
        kwargs["device_id"] = root_device
    _init_dist_connection(env, backend, **kwargs)
    return backend


def shard_module(module: torch.nn.Module, cfg: Any, root_device: torch.device) -> torch.nn.Module:
    """Shard ``module`` in place (idempotent): materialize deferred/meta params, wire the step methods."""
    if fp.is_sharded(module):
        return module
    move_torchmetrics(module, root_device)
    if getattr(cfg, "device", None) is None and any(f.name == "device" for f in dataclasses.fields(cfg)):
        cfg = dataclasses.replace(cfg, device=root_device)
    fp.shard(module, cfg)
    for name in FORWARD_METHODS:
        if callable(getattr(module, name, None)):
            fp.register_forward_method(module, name)
    return module


def move_torchmetrics(module: torch.nn.Module, device: torch.device) -> None:
    """torchmetrics ``Metric`` modules have state but no parameters: put them on the root device."""
    try:
        from torchmetrics import Metric
    except ImportError:
        return
    for metric in (m for m in module.modules() if isinstance(m, Metric)):
        metric.to(device)


@contextmanager
def deferred_init_context(enabled: bool) -> Iterator[None]:
    """``fp.deferred_init()`` when enabled: modules built inside are materialized, sharded, by ``fp.shard``."""
    if not enabled:
        yield
        return
    with fp.deferred_init():
        yield


def barrier(config: Any, name: Any = None) -> None:
    """Lightning's ``strategy.barrier(name)`` through fsdp_plugin's collectives (deadline: ``config.timeout_s``)."""
    from fsdp_plugin._comm import collectives as _collectives

    _collectives.barrier(f"Lightning barrier {name!r}" if name else "Lightning barrier",
                         getattr(config, "timeout_s", None))


def broadcast(config: Any, obj: Any, src: int = 0) -> Any:
    """Lightning's ``strategy.broadcast(obj, src)`` without pickle: rank ``src`` encodes ``obj`` with the package's
    JSON codec (tensors inline) and sends the bytes through fsdp_plugin's collectives (deadline: ``config.timeout_s``).
    A value the codec cannot store raises ``CodecError`` on every rank. ``src`` keeps its own object."""
    import json

    import torch.distributed as dist
    from fsdp_plugin.checkpoint import _comm
    from fsdp_plugin.checkpoint.format import codec
    from fsdp_plugin.errors import CodecError

    payload = None
    if dist.get_rank() == src:
        try:
            payload = json.dumps({"value": codec.encode(obj)}, allow_nan=False).encode()
        except (TypeError, ValueError) as e:
            payload = json.dumps({"error": str(e)}).encode()
    with _comm.deadline(getattr(config, "timeout_s", None), "Lightning broadcast"):
        doc = json.loads(_comm.broadcast_bytes(payload, src, step=f"from rank {src}"))
    if "error" in doc:
        raise CodecError(f"strategy.broadcast from rank {src}: {doc['error']}")
    return obj if dist.get_rank() == src else codec.decode(doc["value"])


def reduce(config: Any, tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """Lightning's ``strategy.reduce`` (in place, like its ``_sync_ddp``) through fsdp_plugin's collectives:
    "mean"/"avg" is a sum divided by the group size (gloo has no AVG); other strings name a ``ReduceOp``."""
    import torch.distributed as dist
    from fsdp_plugin._comm import collectives as _collectives

    op, divide = reduce_op, False
    if reduce_op is None or isinstance(reduce_op, str):
        name = (reduce_op or "mean").lower()
        divide = name in ("avg", "mean")
        op = dist.ReduceOp.SUM if divide else getattr(dist.ReduceOp, name.upper())
    _collectives.all_reduce(tensor, group, op=op, kind="control", what="Lightning reduce",
                            timeout_s=getattr(config, "timeout_s", None))
    if not divide:
        return tensor
    n = _collectives.group_size(group)
    return tensor.div_(n) if torch.is_floating_point(tensor) else tensor / n  # a float mean, as Lightning
