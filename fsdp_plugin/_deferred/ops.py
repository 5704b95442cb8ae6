"""Deferred init, part 1: which aten ops do what (random, factory, data read, whole overwrite, metadata-only)
and the schema helpers that find an op's arguments. Pure functions of the op; no recording state."""
from __future__ import annotations

import torch
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


_HINT = (
    "Build this module eagerly (outside deferred_init()), or on torch.device('meta') with a "
    "reset_parameters() that initializes it without reading tensor values."
)

# Ops that read tensor *values* into Python. On a fake tensor they are answered by replaying what the
# value depends on (deferred_init(data_reads=True), the default), or raise (data_reads=False).
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default: "Tensor.item() / .tolist() / bool(tensor) / `if tensor:`",
    aten.equal.default: "torch.equal()",
    aten.is_nonzero.default: "bool(tensor) / `if tensor:`",
}

# In-place ops that overwrite every element of `self` without reading its old values. If such an op
# covers the whole storage, earlier writes to that storage are dead and need not be replayed.
_OVERWRITE_PACKETS = {
    "uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "exponential_", "cauchy_",
    "log_normal_", "geometric_", "bernoulli_",
}

# Ops that use `self` (args[0]) only for its metadata (shape, dtype, strides), never its values.
_METADATA_ONLY_SELF = {
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
}

# Python-level factory functions that allocate (no data argument): these become fake when no device is
# given. Constructors from data (torch.tensor, as_tensor, asarray) and sparse/nested ones stay real.
_DATA_CONSTRUCTORS = {torch.tensor, torch.as_tensor, torch.asarray}
_FACTORIES = {
    f for f in _device_constructors()
    if getattr(f, "__name__", "") not in {"tensor", "as_tensor", "asarray", "nested_tensor", "empty_quantized"}
    and not getattr(f, "__name__", "").startswith("sparse_")
}


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags or _schema_index(func, "generator") is not None


def _copies_out(func, kwargs) -> bool:
    """``fake.to("cpu")`` (also behind ``.tolist()``): a real tensor from fake values, a data read."""
    device = kwargs.get("device")
    return func is aten._to_copy.default and device is not None and torch.device(device).type != "meta"


def _meta_copy(a):
    if isinstance(a, torch.Tensor) and a.device.type != "meta":
        return a.to("meta")
    return a


def _returns_self(func) -> bool:
    """`func(self, ...) -> Tensor(a!)`: an in-place op returning its (mutated) first argument."""
    schema = func._schema
    if len(schema.returns) != 1 or not schema.arguments:
        return False
    first, ret = schema.arguments[0], schema.returns[0]
    return (first.alias_info is not None and first.alias_info.is_write and ret.alias_info is not None
            and ret.alias_info.before_set == first.alias_info.before_set)


def _schema_index(func, name: str) -> int | None:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return i
    return None


def _schema_values(func, args, kwargs):
    """Yield (schema argument, value) pairs for the arguments actually passed."""
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            yield arg, args[i]
        elif arg.name in kwargs:
            yield arg, kwargs[arg.name]


def _tensors_in(value) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _get_generator(func, args, kwargs):
    i = _schema_index(func, "generator")
    if i is None:
        return None
    if i < len(args):
        return args[i]
    return kwargs.get("generator")


def _with_generator(func, args, kwargs, gen):
    """Return (args, kwargs) with the op's generator argument set to `gen`."""
    i = _schema_index(func, "generator")
    if i < len(args):
        args = list(args)
        args[i] = gen
        return tuple(args), kwargs
    kwargs = dict(kwargs)
    kwargs["generator"] = gen
    return args, kwargs
