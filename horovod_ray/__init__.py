"""horovod_ray: run Horovod (Gloo) training jobs on a Ray cluster.

``RayExecutor`` is imported when first used. A rank's process imports
``horovod_ray.rank.worker`` (the actor's class), which runs this file first: were the job's
side (the executor, both kinds of job, horovod's elastic driver) imported here, every
rank would load it before it could answer, on its way to the first collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from horovod_ray.__version__ import __version__
from horovod_ray.checkpoints.result import Result
from horovod_ray.errors import (
    CheckpointError,
    ConfigError,
    ElasticLimitError,
    ExecutorStateError,
    HangError,
    HorovodRayError,
    NodeDrainingError,
    PlacementTimeoutError,
    RankError,
    RendezvousError,
    StartCancelledError,
    WorkerFailedError,
)
from horovod_ray.failures.restarts import attempt
from horovod_ray.job.lifecycle import ExecutorState
from horovod_ray.rank.logs import log
from horovod_ray.rank.report import get_checkpoint, report
from horovod_ray.run import run
from horovod_ray.settings import Settings

if TYPE_CHECKING:
    from horovod_ray.executor import RayExecutor

__all__ = [
    "CheckpointError",
    "ConfigError",
    "ElasticLimitError",
    "ExecutorState",
    "ExecutorStateError",
    "HangError",
    "HorovodRayError",
    "NodeDrainingError",
    "PlacementTimeoutError",
    "RankError",
    "RayExecutor",
    "RendezvousError",
    "Result",
    "Settings",
    "StartCancelledError",
    "WorkerFailedError",
    "__version__",
    "attempt",
    "get_checkpoint",
    "log",
    "report",
    "run",
]


def __getattr__(name: str) -> Any:
    if name != "RayExecutor":
        raise AttributeError(f"module 'horovod_ray' has no attribute {name!r}")
    from horovod_ray.executor import RayExecutor

    globals()[name] = RayExecutor  # once: later lookups do not come here
    return RayExecutor


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
