"""horovod_ray: run Horovod (Gloo) training jobs on a Ray cluster."""

from horovod_ray.__version__ import __version__
from horovod_ray.errors import (
    ConfigError,
    ElasticLimitError,
    ExecutorStateError,
    HangError,
    HorovodRayError,
    PlacementTimeoutError,
    RendezvousError,
    StartCancelledError,
    WorkerFailedError,
)
from horovod_ray.executor import ExecutorState, RayExecutor
from horovod_ray.logs import log
from horovod_ray.restarts import attempt
from horovod_ray.run import run
from horovod_ray.settings import Settings

__all__ = [
    "ConfigError",
    "ElasticLimitError",
    "ExecutorState",
    "ExecutorStateError",
    "HangError",
    "HorovodRayError",
    "PlacementTimeoutError",
    "RayExecutor",
    "RendezvousError",
    "Settings",
    "StartCancelledError",
    "WorkerFailedError",
    "__version__",
    "attempt",
    "log",
    "run",
]
