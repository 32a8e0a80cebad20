"""hotswap on Ray (`pip install 'hotswap[ray]'`): engines as Ray actors, a trainer-side
group with `EngineGroup`'s commit guarantees, and the `ray` weight-transfer backend
(chunks through the object store). The core package never imports this one."""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError("hotswap.ray needs Ray: pip install 'hotswap[ray]'") from e

from hotswap.ray.actor import EngineActor
from hotswap.ray.group import EngineActorDiedError, RayEngineClient, RayEngineGroup
from hotswap.ray.launch import EngineActors, launch_engines
from hotswap.ray.transfer import RayTrainerInitInfo

__all__ = [
    "EngineActor",
    "EngineActorDiedError",
    "EngineActors",
    "RayEngineClient",
    "RayEngineGroup",
    "RayTrainerInitInfo",
    "launch_engines",
]
