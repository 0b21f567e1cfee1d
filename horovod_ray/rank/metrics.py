"""A rank's metrics: its reports, rank 0's checkpoint uploads, horovod's counters.

Started in a rank's actor when the job records metrics (``observe.job.METRICS_ENV``). The calls
on training's path (``reported``) only count; one sampler thread reads horovod's
counters (``core``) once a second and records the differences, and on rank 0 also keeps
the job's second GCS record (its last report, the slowest rank) for ``horovod-ray
status``. Without :func:`start` every function here does nothing.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
import time
from typing import Any, Mapping

from horovod_ray.checkpoints.metrics import flatten
from horovod_ray.observe import core, registry
from horovod_ray.observe.job import JOB_ID_ENV, JOB_NAME_ENV, METRICS_ENV
from horovod_ray.observe.record import Recorder
from horovod_ray.rank import session
from horovod_ray.rank.logs import rank_now
from horovod_ray.stack.build import core_counters

logger = logging.getLogger(__name__)

# How often the sampler reads horovod's counters and records them.
INTERVAL_S = 1.0


def start(node: str) -> None:
    """Starts this rank's metrics if its job asked for them (its environment is set,
    horovod not yet initialised)."""
    now = session.current()
    modes = set(os.environ.get(METRICS_ENV, "").split(","))
    if now.telemetry is not None or "on" not in modes:
        return
    if "stragglers" in modes and core_counters():
        # horovod's cache lets a tensor seen before skip the coordinator, which then
        # cannot tell which rank was last; a value of the user's wins (its cost:
        # docs/observability.rst). A horovod without the counters attributes nothing.
        os.environ.setdefault("HOROVOD_CACHE_CAPACITY", "0")
    now.telemetry = RankTelemetry(
        os.environ.get(JOB_NAME_ENV, ""),
        os.environ.get(JOB_ID_ENV, ""),
        node,
        values="values" in modes,
    )


def reported(metrics: Mapping[str, Any]) -> None:
    """``report(metrics)`` was called on this rank."""
    telemetry = session.current().telemetry
    if telemetry is not None:
        try:
            telemetry.reported(metrics)
        except Exception:  # noqa: BLE001 - metrics never reach the caller of report()
            logger.debug("a report's metrics were not recorded", exc_info=True)


def call_running(running: bool) -> None:
    """A call of the driver's began (True) or ended (False) on this rank."""
    telemetry = session.current().telemetry
    if telemetry is not None:
        telemetry.in_call = running


def upload_done(seconds: float, size: int) -> None:
    """A checkpoint of ``size`` bytes was committed in ``seconds``."""
    telemetry = session.current().telemetry
    if telemetry is not None:
        telemetry.recorder.inc("horovod_ray_checkpoint_uploads_total")
        telemetry.recorder.inc("horovod_ray_checkpoint_upload_seconds_total", seconds)
        telemetry.recorder.inc("horovod_ray_checkpoint_upload_bytes_total", size)


def data_waited(dataset: str, seconds: float) -> None:
    """This rank waited ``seconds`` for its next batch of ``dataset`` (``rank/datasets``)."""
    telemetry = session.current().telemetry
    if telemetry is not None:
        telemetry.recorder.inc("horovod_ray_data_wait_seconds_total", seconds, dataset=dataset)


def upload_queue(waiting: int) -> None:
    """``waiting`` checkpoints are reported and not yet committed."""
    telemetry = session.current().telemetry
    if telemetry is not None:
        telemetry.recorder.set("horovod_ray_checkpoint_upload_queue", waiting)


def upload_failures(failures: int) -> None:
    """The uploader exists (0) or an upload failed (1)."""
    telemetry = session.current().telemetry
    if telemetry is not None:
        telemetry.recorder.set("horovod_ray_checkpoint_upload_failures", failures)


class RankTelemetry:
    """One rank's metrics and its sampler thread.

    Args:
        job_name: The job's name (a label).
        job_id: The job's id (a label).
        node: This rank's node (its address; a label).
        values: Also export report()'s numbers.
    """

    def __init__(self, job_name: str, job_id: str, node: str, values: bool) -> None:
        self._rank = rank_now()
        self.job_id = job_id
        self.recorder = Recorder(
            {"job_name": job_name, "job_id": job_id, "rank": str(self._rank), "node": node}
        )
        self._values = values
        self.in_call = False
        self._reports = 0
        self._step: float | None = None
        self._last_report_at: float | None = None
        self._previous = core.CoreStats(0.0, 0.0, 0.0, 0.0, 0.0)
        self._waited: dict[int, tuple[float, int]] = {}
        self._collective_at = time.monotonic()
        self._published: tuple | None = None
        self._lib: Any = None
        threading.Thread(target=self._loop, name="horovod_ray-metrics", daemon=True).start()

    def reported(self, metrics: Mapping[str, Any]) -> None:
        self.recorder.inc("horovod_ray_reports_total")
        self._reports += 1
        self._last_report_at = time.time()
        step = metrics.get("step", metrics.get("epoch"))
        self._step = float(step) if _is_number(step) else float(self._reports)
        if self._values:
            for name, value in flatten(metrics).items():
                if _is_number(value):
                    self.recorder.set("horovod_ray_report_value", value, metric=str(name))

    def _loop(self) -> None:
        failed = False
        while True:
            time.sleep(INTERVAL_S)
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - metrics never stop a job; try again
                if not failed:
                    failed = True
                    logger.warning("the rank's metrics sampler failed once", exc_info=True)

    def sample(self) -> None:
        """Records what changed since the last sample."""
        rank = rank_now()
        if rank != self._rank:  # an elastic reset renumbered the ranks
            self._rank = rank
            self.recorder.relabel(rank=str(rank))
        if self._lib is None:
            self._lib = core.library()
        if self._lib is not None:
            self._sample_core(self._lib)
        if rank == 0:
            self._publish()

    def _sample_core(self, lib: Any) -> None:
        now, before, stats = time.monotonic(), self._previous, core.stats(lib)
        self._previous = stats
        record = self.recorder
        record.inc("horovod_ray_collectives_total", stats.collectives - before.collectives)
        record.inc("horovod_ray_collective_bytes_total", stats.bytes - before.bytes)
        record.inc("horovod_ray_collective_seconds_total", stats.seconds - before.seconds)
        if stats.collectives != before.collectives or not self.in_call:
            self._collective_at = now
        stalled = now - self._collective_at if stats.collectives and self.in_call else 0.0
        record.set("horovod_ray_stall_seconds", stalled)
        if stats.init_s != before.init_s and self._rank == 0:
            record.set("horovod_ray_job_start_seconds", stats.rendezvous_s, phase="rendezvous")
            record.set("horovod_ray_job_start_seconds", stats.init_s, phase="hvd_init")
        for rank, (seconds, count) in enumerate(core.waited_for(lib, lib.horovod_size())):
            was_s, was_n = self._waited.get(rank, (0.0, 0))
            record.inc("horovod_ray_waited_for_seconds_total", seconds - was_s, rank=str(rank))
            record.inc("horovod_ray_waited_for_total", count - was_n, rank=str(rank))
            self._waited[rank] = (seconds, count)

    def _publish(self) -> None:
        """Rank 0's GCS record, when it changed."""
        slowest = max(self._waited.items(), key=lambda item: item[1][0], default=None)
        if slowest is not None and slowest[1][0] <= 0:
            slowest = None
        record = {
            "reports": self._reports,
            "step": self._step,
            "last_report_at": self._last_report_at,
            "slowest_rank": None if slowest is None else slowest[0],
            "slowest_waited_s": None if slowest is None else round(slowest[1][0], 3),
        }
        key = tuple(record.values())
        if key != self._published:
            registry.publish(self.job_id, record, rank0=True)
            self._published = key


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
