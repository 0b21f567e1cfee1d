"""One attempt of a RayExecutor's job: its kind (``kinds.JobKind``, the ranks) and its
sides (``sides.JobSides``), made together, brought up together, all or nothing, and
released together. A restart (``max_restarts``) is a new attempt that keeps the job's
telemetry, so the job keeps its id and counts its restarts."""

from __future__ import annotations

import functools
from typing import Callable

from horovod_ray.data.spec import DataSpec
from horovod_ray.job import kinds
from horovod_ray.job.layouts import ElasticLayout, WorkerLayout
from horovod_ray.job.lifecycle import Cancel, ExecutorState, Lifecycle
from horovod_ray.job.sides import JobSides
from horovod_ray.observe.job import JobTelemetry
from horovod_ray.settings import Settings


def _never(err: BaseException) -> bool:
    return False


class JobAttempt:
    """One attempt (see the module).

    Args:
        telemetry: The job's, for a restart; None makes one.
        on_world: An elastic job's (``kinds.create``).

    Attributes:
        kind: The job's kind: its ranks, placement and calls.
        sides: What the job keeps beside its ranks.
    """

    def __init__(
        self,
        settings: Settings,
        layout: WorkerLayout,
        elastic: ElasticLayout | None,
        data: DataSpec | None,
        telemetry: JobTelemetry | None = None,
        on_world: Callable[[int, int], None] | None = None,
    ) -> None:
        self.sides = JobSides(settings, elastic, layout, data, telemetry)
        self.kind = kinds.create(settings, layout, elastic, on_world)
        self._layout = layout

    def prepare(self, env: dict[str, str]) -> None:
        """Before anything is taken: ``env`` gets what every rank is told, the placement
        is planned and the room for the datasets checked (ConfigError for a bad layout)."""
        self.sides.rank_env(env)
        self.kind.prepare()
        self.sides.check_room(self._layout)

    def bring_up(
        self,
        lifecycle: Lifecycle,
        cancel: Cancel,
        env: dict[str, str],
        executable: bytes | None,
        again: Callable[[BaseException], bool] = _never,
    ) -> None:
        """From STARTING: the ranks up, then RUNNING. All or nothing: on a failure what
        was taken is released and the job ends FAILED (STOPPED when stop() cancelled it,
        ``Lifecycle.fail_start``); or, when ``again(err)`` (a restart that will be tried
        again), stays STARTING and ``err`` is raised."""
        kind = self.kind
        self.sides.starting()
        try:
            kind.start(env, executable, cancel.check)
            cancel.check()
            self.sides.started(kind)  # within the rollback: the ranks are up now
        except BaseException as err:  # noqa: BLE001 - re-raised, or what it became
            release = functools.partial(self.release, grace_s=0)
            if cancel.is_set() or not again(err):
                lifecycle.fail_start(err, release, cancel.is_set())
            try:
                release()
            except BaseException:
                lifecycle.transition([ExecutorState.STARTING], ExecutorState.FAILED)
                raise
            raise
        lifecycle.transition([ExecutorState.STARTING], ExecutorState.RUNNING)

    def release(self, grace_s: float, finish: bool = False) -> None:
        """Stops the ranks, then ends the job's side of the run's folder
        (``JobSides.end``: validations waited for if the job ``finish``-ed, the keep
        policy), even when stopping the ranks raised."""
        stopped = False
        try:
            self.kind.stop(grace_s=grace_s)
            stopped = True
        finally:
            self.sides.end(finish and stopped)
