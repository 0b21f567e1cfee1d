"""What a job keeps beside its ranks, the same for both kinds: its metrics and record in
Ray's GCS (``observe.job``), its side of the run's folder (``checkpoints.job``: the
checkpoint to resume from, the validations, the keep policy) and the timeline's request,
each told as the job's life moves (the executor calls them)."""

from __future__ import annotations

from typing import Any

from horovod_ray.checkpoints.job import JobCheckpoints
from horovod_ray.errors import ConfigError
from horovod_ray.job.layouts import ElasticLayout
from horovod_ray.observe.job import JobTelemetry
from horovod_ray.rank.timeline import TIMELINE_ENV
from horovod_ray.settings import Settings


class JobSides:
    """One job's sides (see the module).

    Attributes:
        telemetry: The job's metrics and GCS record; ``run()`` puts one shared by its
            restarts here, so that the job keeps one id and counts them.
        checkpoints: The job's side of the run's folder; None without a storage path.

    Raises:
        ConfigError: A timeline asked of an elastic job (nothing is started yet).
    """

    def __init__(self, settings: Settings, elastic: ElasticLayout | None) -> None:
        if elastic is not None and settings.timeline is not None:
            raise ConfigError(
                "timeline",
                "timeline is for static jobs: an elastic job's rank 0 changes with its "
                "world; leave timeline out (or set HOROVOD_TIMELINE in extra_env_vars for "
                "a file on each rank 0's node)",
            )
        self.telemetry = JobTelemetry.of(settings, elastic is not None)
        self.checkpoints = None
        if settings.storage is not None:
            self.checkpoints = JobCheckpoints(settings.storage, settings.validation)
        self._elastic = elastic
        self._timeline = settings.timeline is not None

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

    def end(self, finished: bool) -> None:
        """The ranks have stopped: the run's folder's side ends (``JobCheckpoints.end``)."""
        if self.checkpoints is not None:
            self.checkpoints.end(finished)
