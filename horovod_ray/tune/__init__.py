"""Ray Tune adapter: every trial is a distributed Horovod job.

``DistributedTrainableCreator(train, num_hosts, num_slots)`` turns an ordinary Tune
function (one that calls ``ray.tune.report`` and ``ray.tune.get_checkpoint``) into a
Trainable whose trials each run ``train`` on ``num_hosts * num_slots`` Horovod ranks.

Open ``trainable`` for the trial's side (its placement, its job, the warm job kept for
the next trial), ``session`` for Tune's report and checkpoint on the ranks (both
halves) and ``parcels`` for how a checkpoint's folder travels between them.
``DistributedTrainableCreator`` is imported when first used: a trial's ranks load
``session`` through this file, and should not load the executor with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from horovod_ray.tune.trainable import DistributedTrainableCreator

__all__ = ["DistributedTrainableCreator"]


def __getattr__(name: str) -> Any:
    if name != "DistributedTrainableCreator":
        raise AttributeError(f"module 'horovod_ray.tune' has no attribute {name!r}")
    from horovod_ray.tune.trainable import DistributedTrainableCreator

    globals()[name] = DistributedTrainableCreator  # once: later lookups do not come here
    return DistributedTrainableCreator


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
