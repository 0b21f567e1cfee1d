"""A job's own metrics and its record in the GCS, kept by the driver.

One :class:`JobTelemetry` per job: a ``RayExecutor``'s, or one ``run()`` shares among the
executors of its restarts, so that the job keeps one id and counts them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import uuid
from typing import Any, Mapping

from horovod_ray.observe import registry
from horovod_ray.observe.record import Recorder

logger = logging.getLogger(__name__)

# What the ranks are told (settings.MANAGED_ENV has them: the user may not set them).
JOB_ID_ENV = "HOROVOD_RAY_JOB_ID"
JOB_NAME_ENV = "HOROVOD_RAY_JOB_NAME"
# What a rank records, comma-separated: "on" (its metrics), "values" (its report()
# values), "stragglers" (horovod's cache off, for the straggler's attribution).
METRICS_ENV = "HOROVOD_RAY_METRICS"
STATES = ("created", "starting", "running", "stopping", "stopped", "failed")
# Longest a final state waits for its record to reach the GCS.
FLUSH_S = 2.0


class JobTelemetry:
    """The driver's side of one job's metrics (see ``catalog``) and GCS record.

    Args:
        name: The job's name.
        kind: "static" or "elastic".
        metrics: Record metrics (the GCS record is kept either way: it costs a write
            per change of state).
        report_values: The ranks also export their report() values.
        find_stragglers: horovod's coordinator sees every collective's requests
            (horovod's response cache off), so rank 0 can name the rank waited for.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        metrics: bool,
        report_values: bool = False,
        find_stragglers: bool = False,
    ) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.name = name
        self._metrics = metrics
        self._report_values = report_values
        self._find_stragglers = find_stragglers
        self._recorder = Recorder({"job_name": name, "job_id": self.id}) if metrics else None
        self._lock = threading.Lock()
        self._published_failed = False
        # The record's writes, in order, by one thread (see _update).
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._record: dict[str, Any] = {
            "id": self.id,
            "name": name,
            "kind": kind,
            "state": "created",
            "ranks_wanted": 0,
            "ranks_alive": 0,
            "restarts": 0,
            "resets": 0,
            "started_at": time.time(),
            "ray_job_id": None,
            # The actor that runs the job (a Tune trial's), None for a script: its end
            # leaves the job lost though the Ray job lives on.
            "driver_actor": None,
            "driver_pid": os.getpid(),
        }

    @classmethod
    def of(cls, settings: Any, elastic: bool, name: str | None = None) -> JobTelemetry:
        """The telemetry ``settings`` ask for; the job is named ``settings.name``, else
        ``name``, else "job"."""
        return cls(
            settings.name or name or "job",
            "elastic" if elastic else "static",
            settings.metrics,
            settings.report_values,
            settings.find_stragglers,
        )

    def rank_env(self) -> dict[str, str]:
        """What every rank is told: the job's name and id, what it records."""
        env = {JOB_ID_ENV: self.id, JOB_NAME_ENV: self.name}
        if self._metrics:
            modes = (
                ["on"] + ["values"] * self._report_values + ["stragglers"] * self._find_stragglers
            )
            env[METRICS_ENV] = ",".join(modes)
        return env

    def state(self, state: str) -> None:
        """The job moved to ``state`` (one of :data:`STATES`); called as it moves, under
        the executor's lifecycle lock, so it only records and queues (see
        :meth:`_update`); running and the final states wait up to ``FLUSH_S`` for the GCS
        to have them."""
        if self._recorder is not None:
            for each in STATES:
                self._recorder.set("horovod_ray_job_state", float(each == state), state=each)
        changes: dict[str, Any] = {"state": state}
        if state in ("stopped", "failed"):
            changes["ranks_alive"] = 0
            self._ranks_alive(0)
        # Once start() or stop() returns, horovod-ray status says so.
        self._update(changes, flush=state in ("running", "stopped", "failed"))

    def ranks(self, wanted: int, alive: int) -> None:
        """How many ranks the job asks for and runs now (as it starts)."""
        if self._recorder is not None:
            self._recorder.set("horovod_ray_job_ranks_wanted", wanted)
        self._ranks_alive(alive)
        self._counts(ranks_wanted=wanted, ranks_alive=alive)

    def started(self, phases: Mapping[str, float]) -> None:
        """The start's phases (placement, actors, environment), in seconds."""
        if self._recorder is not None:
            for phase, seconds in phases.items():
                self._recorder.set("horovod_ray_job_start_seconds", seconds, phase=phase)

    def restarted(self) -> None:
        """The job starts again after a failure."""
        with self._lock:
            restarts = self._record["restarts"] + 1
        self._counts(restarts=restarts)

    def world(self, size: int, resets: int) -> None:
        """An elastic job's world formed (``resets`` 0) or changed."""
        self._ranks_alive(size)
        self._counts(ranks_alive=size, resets=resets)

    def _counts(self, **changes: int) -> None:
        self._update(changes)
        if self._recorder is not None:
            self._recorder.set("horovod_ray_job_restarts", self._record["restarts"])
            self._recorder.set("horovod_ray_job_elastic_resets", self._record["resets"])

    def _ranks_alive(self, alive: int) -> None:
        if self._recorder is not None:
            self._recorder.set("horovod_ray_job_ranks_alive", alive)

    def _update(self, changes: Mapping[str, Any], flush: bool = False) -> None:
        """Queues the record with ``changes`` for the GCS (once Ray runs): one thread
        writes them in order, so a slow or absent GCS never holds up the job, and any
        failure is logged once and goes no further."""
        try:
            import ray

            with self._lock:
                self._record.update(changes, updated_at=time.time())
                if not ray.is_initialized():
                    return  # a job that never started: nothing to list
                if self._record["ray_job_id"] is None:
                    context = ray.get_runtime_context()
                    self._record["ray_job_id"] = context.get_job_id()
                    self._record["driver_actor"] = context.get_actor_id()
                    # Records of jobs long ended go as each job starts, listed or not.
                    threading.Thread(
                        target=self._prune, name="horovod_ray-job-records", daemon=True
                    ).start()
                if self._writer is None:
                    self._writer = threading.Thread(
                        target=self._write, name="horovod_ray-job-record", daemon=True
                    )
                    self._writer.start()
                writer = self._writer
                self._queue.put(dict(self._record))
            if flush:
                deadline = time.monotonic() + FLUSH_S
                while self._queue.unfinished_tasks and time.monotonic() < deadline:
                    time.sleep(0.002)
                if changes.get("state") in ("stopped", "failed"):
                    writer.join(max(0.0, deadline - time.monotonic()))  # it ends after it
        except Exception:  # noqa: BLE001 - the record never stops a job
            self._failed_once("queued")

    def _write(self) -> None:
        """The writer's loop; it ends once it wrote a final state and nothing is queued
        (the next change, a restart's, starts another), so a job leaves no thread."""
        while True:
            record = self._queue.get()
            try:
                registry.publish(self.id, record)
            except Exception:  # noqa: BLE001 - the record never stops a job
                self._failed_once("written to Ray's GCS")
            finally:
                self._queue.task_done()
            if record["state"] in ("stopped", "failed"):
                with self._lock:
                    if self._queue.empty():
                        self._writer = None
                        return

    def _prune(self) -> None:
        try:
            registry.prune()
        except Exception:  # noqa: BLE001 - the records never stop a job
            logger.debug("the ended jobs' records were not pruned", exc_info=True)

    def _failed_once(self, what: str) -> None:
        if not self._published_failed:
            self._published_failed = True
            logger.warning("the job's record could not be %s", what, exc_info=True)
