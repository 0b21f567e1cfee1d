"""The ranks' resources kept out of Ray Data's budget, as Ray Train keeps its workers'.

Ray Data sizes its work from what Ray's ``AutoscalingCoordinator`` reserves for it; Ray
Train registers its workers' resources there first, at a higher priority, so that Ray Data
counts only what is left. Ray offers no public call for it: this module is the only place
that uses Ray Train's (``TrainV1ResourceReservation``, private), and
``test/data/test_budget.py`` fails the day Ray changes it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Mapping

import ray

logger = logging.getLogger(__name__)


class RankReservation:
    """The job's ranks registered with Ray Data's coordinator while the job runs (renewed
    by Ray's own thread); :meth:`close` takes them out. A Ray that cannot register them
    leaves a warning, never a failed job: Ray Data then counts the ranks' CPUs as its own.

    Args:
        per_rank: What each rank reserves (``{"CPU": 1.0}``).
        ranks: How many ranks.
    """

    def __init__(self, per_rank: Mapping[str, float], ranks: int) -> None:
        self.requester_id = f"horovod_ray-{uuid.uuid4().hex[:12]}"
        self._held: Any = None
        try:
            from ray.train import ScalingConfig
            from ray.train._internal.autoscaling_coordinator_client import (
                TrainV1ResourceReservation,
            )

            scaling = ScalingConfig(num_workers=ranks, resources_per_worker=dict(per_rank))
            held = TrainV1ResourceReservation(self.requester_id, scaling, ranks)
            held.__enter__()
            self._held = held
        except Exception:  # noqa: BLE001 - Ray Data still runs, counting the ranks' CPUs
            logger.warning(
                "could not keep the ranks' resources out of Ray Data's budget", exc_info=True
            )

    def close(self) -> None:
        """Takes the reservation out (once)."""
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)


def spare_cpus(per_rank_cpus: float, ranks: int) -> float:
    """The cluster's CPUs the job's ranks leave to Ray Data now."""
    return ray.cluster_resources().get("CPU", 0.0) - per_rank_cpus * ranks
