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
from typing import Any, Mapping

NAMESPACE = "horovod_ray"
PREFIX = "jobs/"
RANK0 = "/rank0"
# States after which a job runs no more.
ENDED = frozenset({"stopped", "failed", "lost"})
# How long a job that ended stays listed (--all); then jobs() removes its records.
KEEP_ENDED_S = 3600.0


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
            the last hour; older ones' records are removed from the GCS here.

    Returns:
        One :class:`JobStatus` per job.

    Raises:
        HorovodRayError: Ray is not initialised.
    """
    import ray
    from ray.experimental import internal_kv

    from horovod_ray.errors import HorovodRayError

    if not ray.is_initialized():
        raise HorovodRayError(
            "horovod_ray.jobs() reads the cluster's GCS: call ray.init(address=...) first"
        )
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
    dead = _dead_drivers()
    now = time.time()
    found = []
    for job_id, record in records.items():
        job = _status(record, rank0.get(job_id, {}), record.get("ray_job_id") in dead, now)
        if job.state in ENDED and now - record.get("updated_at", job.started_at) > KEEP_ENDED_S:
            for key in (PREFIX + job_id, PREFIX + job_id + RANK0):
                internal_kv._internal_kv_del(key, namespace=NAMESPACE)
        else:
            found.append(job)
    found.sort(key=lambda job: job.started_at)
    return found if all else [job for job in found if job.state not in ENDED]


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


def _dead_drivers() -> set[str]:
    """The Ray job ids (hex) of drivers that have ended."""
    from ray._private import state

    return {job["JobID"] for job in state.jobs() if job.get("IsDead")}
