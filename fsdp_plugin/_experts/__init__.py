"""Expert parallelism inside data parallel ("dp2ep", ``ShardingConfig(expert_parallel=E)``).

* ``detect.py``: which modules are experts (transformers 5's fused experts modules, found by their
  ``use_experts_implementation`` marker and their ``[num_experts, ...]`` parameters; per-expert containers by
  structure), and the refusals.
* ``spec.py`` (a leaf: the flat layout, norms and checkpoints import it): the spec recorded on each experts
  parameter (``p._fp_ep``: its box of the global tensor), the experts' `ExpertMesh`, the gather to the global tensor.
* ``layout.py``: the groups (an EP group is E consecutive ranks of a shard group; the experts' own shard group,
  "efsdp", is the ranks with the same EP coordinate) and ``prepare``, which cuts each experts parameter to this
  rank's experts and installs the dispatch, at ``fp.shard``.
* ``dispatch.py``: the experts module's forward, wrapped: tokens go by all-to-all to the ranks owning their
  experts, run through the model's own experts code there, and come back by the reverse all-to-all.
* ``per_expert.py``: the older form (a ``ModuleList``/``ModuleDict`` of per-expert modules, routed by the block's
  own code): the block runs twice, capturing its expert calls, exchanging them once, replaying with the outputs.
* ``router_bias.py``: ``fp.update_router_bias``, DeepSeek-V3's router bias update on every rank's summed loads.
* ``aux_loss.py``: the router's auxiliary loss on the global batch.

The rest of the engine sees experts as one more flat handle per unit, whose mesh is an `ExpertMesh`, and as
boxes of global tensors in checkpoints (``_flat/layout.py``), as tensor-parallel boxes are.
"""
