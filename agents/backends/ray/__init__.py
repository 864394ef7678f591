"""The ``ray`` execution backend: a node's workers as Ray actors pinned to that node's Ray node,
and one driver actor per job running the RL loop over them (docs/ray-backend.md).

``RayBackend`` is imported from ``agents.backends.ray.backend`` (the registry names it so): this
package's own import stays free of Ray, torch and megatron-core.
"""
