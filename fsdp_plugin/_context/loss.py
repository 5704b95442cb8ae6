"""The loss one process would compute, on every rank of a context-parallel group.

Each rank's model computed ``sum of its tokens' losses / N`` with N the batch's global valid-label count
(``split.split_inputs`` passes it as ``num_items_in_batch``), so the group's sum is the whole batch's loss. The
returned loss has that value and backpropagates only this rank's own part: the sum over the group of the
ranks' gradients is then the whole batch's gradient (the gradient reduction sums over cp, ``Mesh.reduce_world``).
"""
from __future__ import annotations

from .._comm import collectives as comm


def finish_loss(output, group):
    if isinstance(output, tuple):
        return (_global(output[0], group),) + tuple(output[1:])
    if getattr(output, "loss", None) is None:
        return output
    output["loss"] = _global(output["loss"], group)
    return output


def _global(local, group):
    total = local.detach().clone()
    comm.all_reduce(total, group, what="context-parallel loss sum", kind="cp_loss")
    # value: exactly the group's sum; gradient: this rank's part only (local - local.detach() is 0 in value)
    return total + (local - local.detach())
