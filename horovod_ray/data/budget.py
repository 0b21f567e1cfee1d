"""The ranks' resources kept out of Ray Data's budget, as Ray Train keeps its workers'.

Ray Data sizes its work from what Ray's ``AutoscalingCoordinator`` reserves for it; Ray
Train registers its workers' resources there first, at a higher priority, so that Ray Data
counts only what is left. Ray offers no public call for it: this module is the only place
that uses Ray Train's (``TrainV1ResourceReservation``, private), and
``test/data/test_budget.py`` fails the day Ray changes it.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any, Mapping

import ray

from horovod_ray import local_ray
from horovod_ray.errors import ConfigError

logger = logging.getLogger(__name__)


class RankReservation:
    """The job's ranks registered with Ray Data's coordinator while the job runs (renewed
    by Ray's own thread); :meth:`close` takes them out. A Ray that cannot register them
    leaves a warning, never a failed job: Ray Data then counts the ranks' CPUs as its own.

    Args:
        per_rank: What each rank reserves (``{"CPU": 1.0}``).
        num_ranks: How many ranks.
    """

    def __init__(self, per_rank: Mapping[str, float], num_ranks: int) -> None:
        self.requester_id = f"horovod_ray-{uuid.uuid4().hex[:12]}"
        self._held: Any = None
        try:
            # Ray AIR's class, whichever Ray Train API the process has (v1's default
            # would add a trainer's CPU, which a job of ours does not have).
            from ray.air.config import ScalingConfig
            from ray.train._internal.autoscaling_coordinator_client import (
                TrainV1ResourceReservation,
            )

            scaling = ScalingConfig(
                num_workers=num_ranks,
                resources_per_worker=dict(per_rank),
                use_gpu=per_rank.get("GPU", 0) > 0,
                trainer_resources={},
            )
            held = TrainV1ResourceReservation(self.requester_id, scaling, num_ranks)
            held.__enter__()
            self._held = held
        except Exception:  # noqa: BLE001 - Ray Data still runs, counting the ranks' CPUs
            logger.warning(
                "could not keep the ranks' resources out of Ray Data's budget", exc_info=True
            )

    def close(self) -> None:
        """Takes the reservation out (once); a failure leaves a warning (the request
        expires on its own after Ray's 180 s), never a failed stop."""
        held, self._held = self._held, None
        if held is not None:
            try:
                held.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - stop() goes on; Ray lets it expire
                logger.warning("could not take the ranks' reservation out", exc_info=True)


def check_room(per_rank_cpus: float, num_ranks: int) -> None:
    """Refuses a job whose ranks leave Ray Data less than one of the cluster's CPUs: its
    tasks (reads, ``map_batches``) would wait for a CPU, and the ranks for them, for
    ever. A Ray this process started cannot grow, and is refused; a cluster (an
    autoscaler may add nodes) gets a warning.

    Raises:
        ConfigError: On a local Ray, naming the fix.
    """
    total = ray.cluster_resources().get("CPU", 0.0)
    taken = per_rank_cpus * num_ranks
    if total - taken >= 1:
        return
    message = (
        f"datasets=: the job's {num_ranks} ranks take {taken:g} of this Ray's {total:g} CPUs, "
        "leaving Ray Data less than one for its tasks (reads, map_batches), which the "
        "ranks would wait for; start Ray with more CPUs before making the datasets "
        f"(ray.init(num_cpus={math.ceil(taken) + 1})), add a node, or give the ranks "
        "fewer (cpus_per_slot / cpus_per_worker)"
    )
    if local_ray.started_here():
        raise ConfigError("datasets", message)
    logger.warning("%s (a warning: an autoscaler may still add a node)", message)
