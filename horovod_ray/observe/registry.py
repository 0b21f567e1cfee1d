"""The jobs running on a cluster, from Ray's GCS: ``horovod_ray.jobs()`` and
``horovod-ray status``.

Each job's driver keeps one record in the GCS's key-value store (its state, ranks,
restarts), updated as they change; rank 0 keeps a second beside it (its last report,
the slowest rank), at most once a second. No server of this package's runs for it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Iterable, Mapping

NAMESPACE = "horovod_ray"
PREFIX = "jobs/"
RANK0 = "/rank0"
# States after which a job runs no more.
ENDED = frozenset({"stopped", "failed", "lost"})
# How long a job that ended stays listed (--all), from when it ended (a lost job: when
# its driver did); then its records are removed.
KEEP_ENDED_S = 3600.0
# The most ended jobs whose records are kept, the latest to end (a long Tune sweep ends
# a job per trial, and nobody may list them).
MAX_ENDED = 1000


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """One job, as ``horovod-ray status`` lists it.

    Attributes:
        name: The job's name (``create_settings(name=...)``, ``run(name=...)``, or the
            training function's).
        id: The job's id, unique on the cluster (the metrics' ``job_id`` label).
        state: created, starting, running, stopping, stopped, failed; or lost, when the
            driver that ran it is gone without having stopped it.
        kind: "static" or "elastic".
        ranks_wanted: Ranks the job asks for.
        ranks_alive: Ranks running now.
        restarts: Restarts after failures so far.
        resets: An elastic job's changes of world so far.
        reports: Calls to ``report()`` rank 0 made (its step count).
        step: The last report's ``step`` (or ``epoch``) value where it had one, else
            ``reports``; None before the first.
        last_report_age_s: Seconds since that report; None before the first.
        slowest_rank: The rank the others waited for longest (horovod's coordinator; of
            every collective only with ``find_stragglers=True``, else of those it
            negotiated), or None when no rank was waited for.
        slowest_waited_s: Seconds they waited for it.
        started_at: When the driver created the job (seconds since the epoch).
    """

    name: str
    id: str
    state: str
    kind: str
    ranks_wanted: int
    ranks_alive: int
    restarts: int
    resets: int
    reports: int
    step: float | None
    last_report_age_s: float | None
    slowest_rank: int | None
    slowest_waited_s: float | None
    started_at: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def publish(job_id: str, record: Mapping[str, Any], rank0: bool = False) -> None:
    """Writes a job's record (the driver's, or ``rank0``'s) to the GCS."""
    from ray.experimental import internal_kv

    key = PREFIX + job_id + (RANK0 if rank0 else "")
    internal_kv._internal_kv_put(key, json.dumps(dict(record)), overwrite=True, namespace=NAMESPACE)


def jobs(all: bool = False) -> list[JobStatus]:  # noqa: A002 - the command line's --all
    """The horovod_ray jobs on the cluster this process is connected to
    (``ray.init(address=...)``), oldest first.

    Args:
        all: Also those that ended (stopped, failed, or lost with their driver) within
            the last hour, the latest 1,000 at most; older ones' records are removed
            from the GCS here (see :func:`expired`).

    Returns:
        One :class:`JobStatus` per job.

    Raises:
        HorovodRayError: Ray is not initialised.
    """
    import ray

    from horovod_ray.errors import HorovodRayError

    if not ray.is_initialized():
        raise HorovodRayError(
            "horovod_ray.jobs() reads the cluster's GCS: call ray.init(address=...) first"
        )
    found = _sweep(time.time())
    return found if all else [job for job in found if job.state not in ENDED]


def prune() -> None:
    """Removes the records of jobs that ended too long ago, or beyond the
    :data:`MAX_ENDED` latest, as :func:`jobs` does: each job's driver runs it as the job
    starts, so the records stay bounded when nobody lists them. Needs Ray."""
    _sweep(time.time())


def expired(ended_at: Mapping[str, float], now: float) -> list[str]:
    """Which ended jobs' records go: those that ended over :data:`KEEP_ENDED_S` ago, and
    the earliest to end beyond the :data:`MAX_ENDED` latest.

    Args:
        ended_at: Job id -> when it ended (seconds since the epoch).
        now: The time now.
    """
    recent = sorted((at, job_id) for job_id, at in ended_at.items() if now - at <= KEEP_ENDED_S)
    over = recent[: max(0, len(recent) - MAX_ENDED)]
    return [job_id for job_id, at in ended_at.items() if now - at > KEEP_ENDED_S] + [
        job_id for _, job_id in over
    ]


def _sweep(now: float) -> list[JobStatus]:
    """Every job's status, oldest first, less those whose records it removes."""
    from ray.experimental import internal_kv

    records: dict[str, dict] = {}
    rank0: dict[str, dict] = {}
    for key in internal_kv._internal_kv_list(PREFIX, namespace=NAMESPACE):
        value = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if value is None:
            continue  # removed since it was listed
        name = key.decode()[len(PREFIX) :]
        if name.endswith(RANK0):
            rank0[name[: -len(RANK0)]] = json.loads(value)
        else:
            records[name] = json.loads(value)
    gone = _drivers_gone(records.values(), now)
    found: dict[str, JobStatus] = {}
    ended_at: dict[str, float] = {}
    for job_id, record in records.items():
        job = _status(record, rank0.get(job_id, {}), job_id in gone, now)
        found[job_id] = job
        if record["state"] in ENDED:
            ended_at[job_id] = record.get("updated_at", job.started_at)  # its last write
        elif job_id in gone:
            ended_at[job_id] = gone[job_id]  # lost: when its driver ended
    for job_id in expired(ended_at, now):
        for key in (PREFIX + job_id, PREFIX + job_id + RANK0):
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)
        del found[job_id]
    return sorted(found.values(), key=lambda job: job.started_at)


def _status(record: dict, rank0: dict, driver_gone: bool, now: float) -> JobStatus:
    state = record["state"]
    if driver_gone and state not in ENDED:
        state = "lost"
    last_at = rank0.get("last_report_at")
    return JobStatus(
        name=record["name"],
        id=record["id"],
        state=state,
        kind=record["kind"],
        ranks_wanted=record["ranks_wanted"],
        ranks_alive=0 if state in ENDED else record["ranks_alive"],
        restarts=record["restarts"],
        resets=record["resets"],
        reports=rank0.get("reports", 0),
        step=rank0.get("step"),
        last_report_age_s=None if last_at is None else max(0.0, now - last_at),
        slowest_rank=rank0.get("slowest_rank"),
        slowest_waited_s=rank0.get("slowest_waited_s"),
        started_at=record["started_at"],
    )


def _drivers_gone(records: Iterable[dict], now: float) -> dict[str, float]:
    """Job id -> when its driver ended, for the jobs not ended whose driver is gone: a
    Ray job (a script) that ended, or the actor that ran it (a Tune trial's, killed while
    Tune's own driver lives). Where Ray does not say when, the record's last write."""
    from ray._private import state

    running = [record for record in records if record["state"] not in ENDED]
    if not running:
        return {}
    dead_jobs = {job["JobID"]: job.get("EndTime") or 0 for job in state.jobs() if job.get("IsDead")}
    gone = {}
    for record in running:
        ended_ms = dead_jobs.get(record.get("ray_job_id"))
        actor = record.get("driver_actor")
        if ended_ms is None and actor:
            entry = state.actors(actor) or {}
            ended_ms = (entry.get("EndTime") or 0) if entry.get("State") == "DEAD" else None
        if ended_ms is not None:
            gone[record["id"]] = ended_ms / 1000 if ended_ms else record.get("updated_at", now)
    return gone
