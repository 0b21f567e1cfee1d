"""An elastic job: horovod's own elastic driver decides the world, Ray places the ranks.

The job holds nothing between runs: each ``run()`` is one
:class:`~horovod_ray.job.elastic_run.ElasticRun`, which starts, re-forms and ends the
ranks; this is the job kind the executor sees, which admits one run at a time and refuses
every other call.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from ray.util.client import ray as ray_client

from horovod_ray.errors import ExecutorStateError, HorovodRayError
from horovod_ray.job.elastic_run import ElasticRun
from horovod_ray.job.layouts import ElasticLayout, WorkerLayout
from horovod_ray.rank import calls
from horovod_ray.settings import Settings

logger = logging.getLogger(__name__)

STOP_RUN_S = 30.0  # longest stop() waits for a run in progress to release what it holds


class ElasticJob:
    """The job kind of ``RayExecutor(min_workers=...)``: it holds nothing between runs,
    and takes one ``run()`` at a time (its ranks exist only while that runs).

    Args:
        settings: Timeouts, interfaces, verbosity.
        layout: The elastic bounds and limits.
        worker: What one rank reserves (the executor's layout).
        on_world: Called with (size, resets) each time a run's world forms or changes.
    """

    def __init__(
        self,
        settings: Settings,
        layout: ElasticLayout,
        worker: WorkerLayout,
        on_world: Callable[[int, int], None] | None = None,
    ) -> None:
        self._settings, self._layout, self._worker = settings, layout, worker
        self._on_world = on_world
        self._extra_env: dict[str, str] = {}
        self._executable: bytes | None = None
        self._lock = threading.Lock()
        self._current: ElasticRun | None = None
        self.datasets: dict[str, Any] | None = None

    def give_datasets(self, shards: dict[str, Any]) -> None:
        """Each rank's iterators over the job's datasets (ordered splits, the same for
        every rank): handed to every slot's rank as it is set up."""
        self.datasets = shards

    def prepare(self) -> None:
        """Refuses a Ray Client driver, which the ranks cannot reach."""
        if ray_client.is_connected():
            raise HorovodRayError(
                "elastic jobs need their driver inside the cluster (horovod's elastic "
                "driver answers the ranks directly), not a Ray Client (ray://) driver; "
                "submit the script with `ray job submit` instead"
            )

    def start(
        self, extra_env: dict[str, str], executable: bytes | None, check: Callable[[], None]
    ) -> None:
        """Takes nothing: each run() places its own ranks, with these (env, executable)."""
        self._extra_env, self._executable = extra_env, executable

    def started_message(self) -> str | None:
        return None

    def refuse(self, action: str, call: calls.Call | None) -> None:
        """Refuses everything but ``run()``, in any state.

        Raises:
            ExecutorStateError: Naming what to use instead.
        """
        if action != "run" or call is None or call.args is None:
            raise ExecutorStateError(
                f"{action} is not available on an elastic job: its ranks exist only while "
                f"run() runs (use run(fn), with hvd.elastic.run inside fn)"
            )

    def admit(self) -> None:
        """Claims the job for one ``run()``.

        Raises:
            ExecutorStateError: Another run() is in progress.
        """
        with self._lock:
            if self._current is not None:
                raise ExecutorStateError(
                    "run needs a running elastic executor, this one is running: another "
                    "run() is in progress"
                )
            self._current = ElasticRun(
                self._settings,
                self._layout,
                self._worker,
                self._extra_env,
                self._executable,
                self._on_world,
                self.datasets,
            )

    def call(
        self,
        call: calls.Call,
        callbacks: list[Callable[[dict], None]],
        all_ranks: bool = True,
        failing: Callable[[], bool] = lambda: True,
    ) -> list[Any]:
        """Runs an admitted ``run()`` elastically to its end (see :meth:`ElasticRun.run`);
        it has released everything by the time it raises, so ``failing`` is not needed."""
        try:
            return self._current.run(call.fn, call.args, callbacks)
        finally:
            with self._lock:
                self._current = None

    def stop(self, grace_s: float) -> None:
        """Ends a run in progress (its run() raises in the caller's thread) and waits."""
        with self._lock:
            current = self._current
        if current is not None:
            current.stop()
            if not current.wait_ended(STOP_RUN_S):
                logger.warning("the elastic run did not end within %gs", STOP_RUN_S)
