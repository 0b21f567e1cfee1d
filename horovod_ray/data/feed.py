"""One job's datasets split over its ranks: made as the ranks are up, released with them.

Ray Train's own ``DataConfig.configure`` splits each dataset (``streaming_split(n,
equal=True, locality_hints=<each rank's node>)``, or the whole dataset to every rank for
one it does not split), so a job's ranks read exactly as Ray Train's workers do. Each split
dataset runs in a ``SplitCoordinator`` actor of Ray Data's: :meth:`DatasetFeed.close` ends
it, whatever ended the job.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import ray

from horovod_ray.data.budget import RankReservation, check_room
from horovod_ray.data.spec import DataSpec

if TYPE_CHECKING:
    from ray.data import DataIterator

logger = logging.getLogger(__name__)

# Seconds a split's coordinator gets to stop its executor before it is killed.
SHUTDOWN_S = 5.0


class DatasetFeed:
    """The split of one job's datasets (see the module).

    Args:
        spec: The datasets and their ``DataConfig``.
        per_rank: What each rank reserves (``{"CPU": 1.0}``): kept out of Ray Data's
            budget while the feed is open.
    """

    def __init__(self, spec: DataSpec, per_rank: Mapping[str, float]) -> None:
        self.spec = spec
        self._per_rank = dict(per_rank)
        self._coordinators: list[Any] = []
        self._reservation: RankReservation | None = None
        self._materialized: dict[str, tuple[Any, int]] = {}

    def open(
        self, node_ids: Sequence[str], actors: Sequence[Any] | None = None
    ) -> list[dict[str, DataIterator]]:
        """Splits the datasets over ranks on ``node_ids`` (in world-rank order), one
        dataset at a time, each split's coordinator recorded as soon as it exists.

        Args:
            node_ids: Each rank's node, in world-rank order (the locality hints).
            actors: The ranks' actors, for a ``DataConfig`` subclass that reads them.

        Returns:
            Each rank's iterators by dataset name, in world-rank order.
        """
        num_ranks = len(node_ids)
        self._claim(num_ranks)
        per_rank: list[dict[str, DataIterator]] = [{} for _ in range(num_ranks)]
        for name, dataset in self.spec.datasets.items():
            made = self.spec.config.configure(
                datasets={name: dataset},
                world_size=num_ranks,
                worker_handles=None if actors is None else list(actors),
                worker_node_ids=list(node_ids),
            )
            self._coordinators.extend(_coordinators(made))
            for mine, iterators in zip(per_rank, made, strict=True):
                mine.update(iterators)
        return per_rank

    def _claim(self, num_ranks: int) -> None:
        """Room for Ray Data beside ``num_ranks`` ranks (:meth:`check_room`), then the
        ranks' resources reserved out of its budget (once)."""
        self.check_room(num_ranks)
        if self._reservation is None and any(v > 0 for v in self._per_rank.values()):
            self._reservation = RankReservation(self._per_rank, num_ranks)

    def materialize(
        self, num_ranks: int | None
    ) -> tuple[dict[str, tuple[Any, int]], dict[str, Any]]:
        """The ordered split: each split dataset materialized in order, with its rows
        (held here until :meth:`close`), and each other dataset's whole iterator.

        Args:
            num_ranks: The most ranks the job has, if known (the room check, the
                reservation).
        """
        if num_ranks is not None:
            self._claim(num_ranks)
        ordered: dict[str, tuple[Any, int]] = {}
        whole: dict[str, Any] = {}
        for name, dataset in self.spec.datasets.items():
            if name not in self.spec.split:
                whole[name] = dataset.iterator()
                continue
            dataset = dataset.copy(dataset)
            dataset.context.execution_options.preserve_order = True
            materialized = dataset.materialize()
            ordered[name] = (materialized, materialized.count())
        self._materialized = ordered
        return ordered, whole

    def close(self) -> None:
        """Stops each split's execution and its coordinator actor, and ends the
        reservation; idempotent, and safe after a failed :meth:`open`."""
        coordinators, self._coordinators = self._coordinators, []
        self._materialized = {}  # its blocks go with the last reference
        try:
            if coordinators:
                stops = [c.shutdown_executor.remote() for c in coordinators]
                ray.wait(stops, num_returns=len(stops), timeout=SHUTDOWN_S)
                for coordinator in coordinators:
                    try:
                        ray.kill(coordinator)
                    except Exception:  # noqa: BLE001 - the next one still goes
                        logger.warning("could not end a split's coordinator", exc_info=True)
        finally:
            reservation, self._reservation = self._reservation, None
            if reservation is not None:
                reservation.close()

    def check_room(self, num_ranks: int) -> None:
        """Refuses (a local Ray) or warns of (a cluster) ranks that leave Ray Data no CPU
        (``budget.check_room``)."""
        check_room(self._per_rank.get("CPU", 0.0), num_ranks)


def _coordinators(per_rank: list[dict[str, DataIterator]]) -> list[Any]:
    """The ``SplitCoordinator`` actors behind the iterators (Ray's ``DatasetManager`` keeps
    them the same way, to shut them down)."""
    from ray.data._internal.iterator.stream_split_iterator import StreamSplitDataIterator

    found: dict[Any, Any] = {}
    for iterators in per_rank:
        for iterator in iterators.values():
            if isinstance(iterator, StreamSplitDataIterator):
                actor = iterator._coord_actor
                found.setdefault(actor._actor_id, actor)
    return list(found.values())
