"""``horovod-ray status``: the horovod_ray jobs on a Ray cluster, from its GCS."""

from __future__ import annotations

import argparse
import json
import os
import sys

from horovod_ray.observe.registry import JobStatus, jobs

_COLUMNS = ("NAME", "ID", "STATE", "RANKS", "RESTARTS", "STEP", "LAST REPORT", "SLOWEST RANK")


def status_command(args: argparse.Namespace) -> int:
    """Prints the jobs; 1 when no cluster answers."""
    import ray

    from horovod_ray import local_ray
    from horovod_ray.errors import HorovodRayError

    address = args.address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        local_ray.join(address, log_to_driver=False, logging_level="ERROR")
    except RuntimeError as err:  # Ray's own refusal of the address
        print(f"horovod-ray status: no Ray cluster at {address!r}: {err}", file=sys.stderr)
        return 1
    except HorovodRayError as err:
        print(f"horovod-ray status: {err}", file=sys.stderr)
        return 1
    try:
        found = jobs(all=args.all)
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps([job.as_dict() for job in found], indent=1))
    elif not found:
        print("no horovod_ray jobs" + ("" if args.all else " running (--all: also ended ones)"))
    else:
        print(table(found))
    return 0


def table(found: list[JobStatus]) -> str:
    """The jobs as aligned columns."""
    rows = [_COLUMNS] + [_row(job) for job in found]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def _row(job: JobStatus) -> tuple[str, ...]:
    step = "-" if job.step is None else f"{job.step:g}"
    age = "-" if job.last_report_age_s is None else f"{job.last_report_age_s:.0f}s ago"
    slowest = (
        "-"
        if job.slowest_rank is None
        else f"{job.slowest_rank} (waited for {job.slowest_waited_s:.1f}s)"
    )
    return (
        job.name,
        job.id,
        job.state,
        f"{job.ranks_alive}/{job.ranks_wanted}",
        str(job.restarts),
        step,
        age,
        slowest,
    )
