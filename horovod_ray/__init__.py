"""horovod_ray: run Horovod (Gloo) training jobs on a Ray cluster.

``RayExecutor`` and ``ElasticRayExecutor`` are imported when first used. A rank's process
imports ``horovod_ray.rank.worker`` (the actor's class), which runs this file first: were
the job's side (the executor, both kinds of job, horovod's elastic driver) imported here,
every rank would load it before it could answer, on its way to the first collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from horovod_ray.__version__ import __version__
from horovod_ray.checkpoints.result import Result
from horovod_ray.errors import (
    CheckpointError,
    ConfigError,
    DatasetNotFoundError,
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
from horovod_ray.observe.registry import JobStatus, jobs
from horovod_ray.rank.context import TrainContext, get_context
from horovod_ray.rank.datasets import get_dataset_shard
from horovod_ray.rank.logs import Callback, log
from horovod_ray.rank.preemption import get_preemption_info
from horovod_ray.rank.report import get_all_reported_checkpoints, get_checkpoint, report
from horovod_ray.run import run
from horovod_ray.settings import Settings

if TYPE_CHECKING:
    from horovod_ray.data.config import DataConfig
    from horovod_ray.elastic import ElasticRayExecutor
    from horovod_ray.executor import RayExecutor
    from horovod_ray.trainer.horovod_trainer import HorovodTrainer

__all__ = [
    "Callback",
    "CheckpointError",
    "ConfigError",
    "DataConfig",
    "DatasetNotFoundError",
    "ElasticLimitError",
    "ElasticRayExecutor",
    "ExecutorState",
    "ExecutorStateError",
    "HangError",
    "HorovodRayError",
    "HorovodTrainer",
    "JobStatus",
    "NodeDrainingError",
    "PlacementTimeoutError",
    "RankError",
    "RayExecutor",
    "RendezvousError",
    "Result",
    "Settings",
    "StartCancelledError",
    "TrainContext",
    "WorkerFailedError",
    "__version__",
    "attempt",
    "get_all_reported_checkpoints",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_preemption_info",
    "jobs",
    "log",
    "report",
    "run",
]


# Imported when first used (see above): name -> its module.
_LAZY = {
    "RayExecutor": "horovod_ray.executor",
    "HorovodTrainer": "horovod_ray.trainer.horovod_trainer",
    "ElasticRayExecutor": "horovod_ray.elastic",
    "DataConfig": "horovod_ray.data.config",
}
# horovod.ray 0.28.1's public names that have no counterpart here, and what to use instead.
_HOROVOD_RAY_ONLY = {
    "BaseHorovodWorker": (
        "horovod.ray's actor class; horovod_ray starts its own: use "
        "RayExecutor.start(executable_cls=...) for your class, and execute(fn) to reach "
        "each rank's instance"
    ),
    "runner": "horovod.ray's module of RayExecutor: use horovod_ray.RayExecutor",
    "adapter": "horovod.ray's internals: use horovod_ray.RayExecutor",
    "strategy": "horovod.ray's placement internals: use RayExecutor's num_workers or num_hosts",
    "driver_service": "horovod.ray's internals: use horovod_ray.RayExecutor",
    "utils": "horovod.ray's internals: use horovod_ray.RayExecutor",
    "worker": "horovod.ray's actor module: use RayExecutor.start(executable_cls=...)",
    "elastic_v2": (
        "horovod.ray's internals of RayExecutor(min_workers=...): use "
        "horovod_ray.RayExecutor(min_workers=..., max_workers=...)"
    ),
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in ("elastic", "ray_logger"):  # horovod.ray's modules of these names
        value = importlib.import_module(f"horovod_ray.{name}")
    elif name in _HOROVOD_RAY_ONLY:
        # ImportError, not AttributeError: `from horovod_ray import X` would replace an
        # AttributeError's message with its own.
        raise ImportError(f"horovod_ray has no {name}: {_HOROVOD_RAY_ONLY[name]}", name=name)
    else:
        raise AttributeError(f"module 'horovod_ray' has no attribute {name!r}")
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
