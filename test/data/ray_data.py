"""What Ray Data's own actors hold, read back for the tests of test/data."""

from __future__ import annotations

import ray


def reserved_cpus(requester_id: str) -> float:
    """The CPUs Ray Data's autoscaling coordinator reserves for ``requester_id`` now
    (a job's ranks, kept out of Ray Data's budget: ``data/budget``)."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    reserved = ray.get(coordinator.get_reserved_resources.remote(requester_id, recompute=True))
    return sum(node.get("CPU", 0) for node in reserved.values())
