"""What a job keeps beside its ranks, the same for both kinds: its metrics and record in
Ray's GCS (``observe.job``), its side of the run's folder (``checkpoints.job``: the
checkpoint to resume from, the validations, the keep policy) and the timeline's request,
each told as the job's life moves (the executor calls them)."""

from __future__ import annotations

from typing import Any

from horovod_ray.checkpoints.job import JobCheckpoints
from horovod_ray.data.feed import DatasetFeed
from horovod_ray.data.spec import DataSpec, check_rows
from horovod_ray.errors import ConfigError
from horovod_ray.job.layouts import ElasticLayout, WorkerLayout
from horovod_ray.observe.job import JobTelemetry
from horovod_ray.rank.ordered import OrderedShard
from horovod_ray.rank.timeline import TIMELINE_ENV
from horovod_ray.settings import Settings


class JobSides:
    """One job's sides (see the module).

    Args:
        telemetry: The job's metrics and GCS record when it has one already (a restart's
            new job keeps its id and counts the restarts); None makes one.

    Attributes:
        telemetry: The job's metrics and GCS record; ``run()`` puts one shared by its
            restarts here, so that the job keeps one id and counts them.
        checkpoints: The job's side of the run's folder; None without a storage path.

    Raises:
        ConfigError: A timeline asked of an elastic job (nothing is started yet).
    """

    def __init__(
        self,
        settings: Settings,
        elastic: ElasticLayout | None,
        layout: WorkerLayout | None = None,
        data: DataSpec | None = None,
        telemetry: JobTelemetry | None = None,
    ) -> None:
        if data is not None:
            _check_data(data, elastic, layout)
        if elastic is not None and settings.timeline is not None:
            raise ConfigError(
                "timeline",
                "timeline is for static jobs: an elastic job's rank 0 changes with its "
                "world; leave timeline out (or set HOROVOD_TIMELINE in extra_env_vars for "
                "a file on each rank 0's node)",
            )
        self.telemetry = telemetry or JobTelemetry.of(settings, elastic is not None)
        self.checkpoints = None
        if settings.storage is not None:
            self.checkpoints = JobCheckpoints(settings.storage, settings.validation)
        self._elastic = elastic
        self._timeline = settings.timeline is not None
        self._feed = None if data is None else DatasetFeed(data, layout.worker_resources())

    def rank_env(self, env: dict[str, str]) -> None:
        """Adds to ``env`` what every rank is told: the storage and the checkpoint to
        resume from, the job's name and id and what it records (the user's variables win
        there: their HOROVOD_CACHE_CAPACITY), and that rank 0 writes the timeline (the job
        brings it to ``settings.timeline`` as it stops: rank/timeline).

        Raises:
            CheckpointError: The run's folder could not be read.
        """
        if self.checkpoints is not None:
            env.update(self.checkpoints.rank_env())
        for key, value in self.telemetry.rank_env().items():
            env.setdefault(key, value)
        if self._timeline:
            env[TIMELINE_ENV] = "1"

    def check_room(self, layout: WorkerLayout) -> None:
        """Before anything is taken: refuses ranks that would leave Ray Data no CPU
        (``data.budget.check_room``), where the layout says how many (an elastic job: its
        ``max_workers``)."""
        if self._feed is None:
            return
        ranks = planned_ranks(layout) if self._elastic is None else self._elastic.max_workers
        if ranks is not None:
            self._feed.check_room(ranks)

    def starting(self) -> None:
        """The job starts: an elastic one says how many ranks it wants."""
        if self._elastic is not None:
            wanted = self._elastic.max_workers or self._elastic.min_workers
            self.telemetry.ranks(wanted, 0)

    def started(self, kind: Any) -> None:
        """The ranks are up (``kind``: the job's ``JobKind``): a static job's count and
        start's phases are recorded, and the run's validations start."""
        if self._elastic is None:
            size = len(kind.ranks)
            self.telemetry.ranks(size, size)
            self.telemetry.started(kind.start_s)
        if self.checkpoints is not None:
            self.checkpoints.start()
        if self._feed is not None:
            self._give_datasets(kind)

    def _give_datasets(self, kind: Any) -> None:
        """Splits the datasets over the ranks that are up, each rank's part to its rank; an
        ordered split (resumable, or an elastic job's) gives every rank the same iterators,
        each cutting its own part as a pass starts."""
        if self._elastic is not None:
            kind.give_datasets(self._ordered_shards(self._elastic.max_workers))
            return
        ranks = kind.ranks
        check_rows(self._feed.spec, len(ranks))
        if self._feed.spec.resumable:
            per_rank = [self._ordered_shards(len(ranks))] * len(ranks)
        else:
            per_rank = self._feed.open([rank.node_id for rank in ranks], kind.actors)
        kind.give_datasets(per_rank)

    def _ordered_shards(self, num_ranks: int | None) -> dict[str, Any]:
        ordered, whole = self._feed.materialize(num_ranks)
        shards = {name: OrderedShard(name, data, rows) for name, (data, rows) in ordered.items()}
        return {**whole, **shards}

    def end(self, finished: bool) -> None:
        """The ranks have stopped: the datasets' split is released and the run's folder's
        side ends (``JobCheckpoints.end``)."""
        try:
            if self._feed is not None:
                self._feed.close()
        finally:
            if self.checkpoints is not None:
                self.checkpoints.end(finished)


def _check_data(data: DataSpec, elastic: ElasticLayout | None, layout: WorkerLayout | None) -> None:
    """Refuses an elastic job with datasets but no ``max_workers``, and a split dataset
    known to have fewer rows than the job's ranks (counted again once they are up)."""
    if elastic is not None:
        if elastic.max_workers is None:
            raise ConfigError(
                "max_workers",
                "an elastic job with datasets= needs max_workers: without it the job grows "
                "onto every CPU, and Ray Data's tasks would have none; give max_workers",
            )
        check_rows(data, elastic.max_workers)
        return
    if layout is not None and (ranks := planned_ranks(layout)) is not None:
        check_rows(data, ranks)


def planned_ranks(layout: WorkerLayout) -> int | None:
    """The ranks a static layout asks for; None where a placement group decides."""
    if layout.hosts is not None:
        return sum(count for _, count in layout.hosts)
    if layout.num_workers is not None:
        return layout.num_workers
    if layout.num_hosts is not None:
        return layout.num_hosts * (layout.num_workers_per_host or 1)
    return None
