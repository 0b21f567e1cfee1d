"""Every metric horovod_ray exports, with its type, labels, unit and meaning.

The one list: the driver and the ranks record only names found here, the docs' table
(docs/observability.rst) is checked against it, and so is what a real Prometheus scrapes.
Ray exports a metric NAME as ``ray_NAME``, adding its own labels (NodeAddress,
SessionName, WorkerId, ...) beside these.
"""

from __future__ import annotations

import dataclasses

# Every series carries the job's name and id (not "job": Prometheus names each scrape
# target's job so), a rank's also its world rank and node.
JOB = ("job_name", "job_id")
RANK = (*JOB, "rank", "node")


@dataclasses.dataclass(frozen=True)
class Metric:
    """One metric: ``kind`` is ``gauge`` or ``counter`` (a counter's name ends in
    ``_total``; Ray exports none until it first counts, so a count that must show 0, such
    as restarts, is a gauge kept by the one process that counts it); ``source`` says
    which process records it."""

    name: str
    kind: str
    labels: tuple[str, ...]
    unit: str
    source: str
    meaning: str


def _gauge(name: str, labels: tuple[str, ...], unit: str, source: str, meaning: str) -> Metric:
    return Metric(name, "gauge", labels, unit, source, meaning)


def _counter(name: str, labels: tuple[str, ...], unit: str, source: str, meaning: str) -> Metric:
    return Metric(name, "counter", labels, unit, source, meaning)


CATALOG: tuple[Metric, ...] = (
    _gauge(
        "horovod_ray_job_state",
        (*JOB, "state"),
        "1",
        "driver",
        "1 for the job's current state (created, starting, running, stopping, stopped, "
        "failed), 0 for the others",
    ),
    _gauge(
        "horovod_ray_job_ranks_wanted",
        JOB,
        "ranks",
        "driver",
        "Ranks the job asks for (an elastic job: max_workers, or min_workers without one)",
    ),
    _gauge(
        "horovod_ray_job_ranks_alive",
        JOB,
        "ranks",
        "driver",
        "Ranks running now: the static job's once started, an elastic job's current world; "
        "0 once stopped",
    ),
    _gauge(
        "horovod_ray_job_restarts",
        JOB,
        "restarts",
        "driver",
        "Restarts of the job after a failure so far (run(..., max_restarts=N))",
    ),
    _gauge(
        "horovod_ray_job_elastic_resets",
        JOB,
        "resets",
        "driver",
        "Times an elastic job's world changed after it first formed, so far (0 for a static job)",
    ),
    _gauge(
        "horovod_ray_job_start_seconds",
        (*JOB, "phase"),
        "seconds",
        "driver; rank 0",
        "The last start, by phase: placement, actors, environment (the driver's); "
        "rendezvous and hvd_init (rank 0's horovod: Gloo's rendezvous, the whole of "
        "hvd.init())",
    ),
    _counter(
        "horovod_ray_reports_total",
        RANK,
        "reports",
        "every rank",
        "Calls to report() on this rank: its rate is the job's steps (or epochs) per second",
    ),
    _gauge(
        "horovod_ray_report_value",
        (*RANK, "metric"),
        "the metric's",
        "every rank",
        "Opt-in (create_settings(report_values=True)): each number the rank last passed to "
        "report(), by its name (nested names joined with '/')",
    ),
    _counter(
        "horovod_ray_checkpoint_uploads_total",
        RANK,
        "checkpoints",
        "rank 0",
        "Checkpoints committed to storage_path",
    ),
    _counter(
        "horovod_ray_checkpoint_upload_seconds_total",
        RANK,
        "seconds",
        "rank 0",
        "Seconds spent uploading them (divide its rate by the uploads' for the mean)",
    ),
    _counter(
        "horovod_ray_checkpoint_upload_bytes_total",
        RANK,
        "bytes",
        "rank 0",
        "Bytes of the checkpoints committed",
    ),
    _gauge(
        "horovod_ray_checkpoint_upload_queue",
        RANK,
        "checkpoints",
        "rank 0",
        "Checkpoints reported and not yet committed: a queue that grows is an upload that "
        "does not keep up",
    ),
    _gauge(
        "horovod_ray_checkpoint_upload_failures",
        RANK,
        "failures",
        "rank 0",
        "Uploads that failed so far: 0 or 1, since nothing is uploaded after a failure (the "
        "next report() or the call's end raises CheckpointError)",
    ),
    _gauge(
        "horovod_ray_stall_seconds",
        RANK,
        "seconds",
        "every rank",
        "While a call runs: seconds since this rank's last collective ended (grows while "
        "the rank waits on a collective or computes without one); 0 between calls",
    ),
    _counter(
        "horovod_ray_collectives_total",
        RANK,
        "collectives",
        "every rank",
        "Collectives horovod executed on this rank (a fused batch counts once)",
    ),
    _counter(
        "horovod_ray_collective_bytes_total",
        RANK,
        "bytes",
        "every rank",
        "Bytes of the tensors those collectives carried",
    ),
    _counter(
        "horovod_ray_collective_seconds_total",
        RANK,
        "seconds",
        "every rank",
        "Seconds horovod spent executing them (after negotiation)",
    ),
    _counter(
        "horovod_ray_data_wait_seconds_total",
        (*RANK, "dataset"),
        "seconds",
        "every rank",
        "Seconds this rank's loop waited for its next batch of a dataset given with "
        "datasets= (get_dataset_shard): a rank that waits here starves for data, one that "
        "the others wait for in horovod_ray_waited_for_seconds_total is slow itself",
    ),
    _counter(
        "horovod_ray_waited_for_seconds_total",
        (*JOB, "rank"),
        "seconds",
        "rank 0",
        "Seconds the job waited for this rank alone, as the last one ready for a collective "
        "horovod's coordinator negotiated (on rank 0, one cycle's resolution); every "
        "collective only with find_stragglers=True",
    ),
    _counter(
        "horovod_ray_waited_for_total",
        (*JOB, "rank"),
        "collectives",
        "rank 0",
        "The times the job waited for this rank alone; every collective only with "
        "find_stragglers=True",
    ),
)

BY_NAME = {metric.name: metric for metric in CATALOG}
