"""The ``ray`` execution backend: a node's workers as Ray actors pinned to that node's Ray node,
and one driver actor per job running the RL loop over them (docs/ray-backend.md).

``RayBackend`` is imported from ``agents.backends.ray.backend`` (the registry names it so): this
package's own import stays free of Ray, torch and megatron-core.
"""

from typing import Final

# Ray's switch for "this machine's nodes talk over loopback only" (its name says Windows/OSX, where
# that is the default; on Linux it is off unless set to 0). Every Ray process of a single-machine
# cluster needs it in its environment before Ray is imported (agents.backends.ray.connection).
LOOPBACK_ENV: Final = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
