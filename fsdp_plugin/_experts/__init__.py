"""Expert parallelism inside data parallel ("dp2ep", ``ShardingConfig(expert_parallel=E)``).

* ``detect.py``: which modules are experts (transformers 5's fused experts modules, found by their
  ``use_experts_implementation`` marker and their ``[num_experts, ...]`` parameters), and the refusals.
* ``layout.py``: the groups (an EP group is E consecutive ranks of a shard group; the experts' own shard group,
  "efsdp", is the ranks with the same EP coordinate), the expert mesh of the experts' flat handles, and the
  slicing of each experts parameter to this rank's box of the global tensor (``p._fp_ep``).
* ``dispatch.py``: the experts module's forward, wrapped: tokens go by all-to-all to the ranks owning their
  experts, run through the model's own experts code there, and come back by the reverse all-to-all.

The rest of the engine sees experts as one more flat handle per unit, whose mesh is an `ExpertMesh`, and as
boxes of global tensors in checkpoints (``_flat/layout.py``).
"""
from .detect import experts_modules
from .layout import EPSpec, ExpertMesh, ep_spec, prepare

__all__ = ["EPSpec", "ExpertMesh", "ep_spec", "experts_modules", "prepare"]
