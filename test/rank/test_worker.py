"""The actor that hosts a rank (rank/worker), on a real local Ray: what its process
loads, and its garbage collector after setup."""

from __future__ import annotations

import sys

import pytest

from horovod_ray import RayExecutor

pytestmark = pytest.mark.timeout(180)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


def test_a_ranks_process_loads_the_actor_not_the_jobs_side(ray_4cpu, no_leaks):
    """Its own job: a function of this module, sent by reference, would import the module
    and with it the executor."""
    job_side = (
        "horovod_ray.executor",
        "horovod_ray.job.static",
        "horovod_ray.job.elastic",
        "horovod_ray.job.elastic_run",
        "horovod.runner.elastic.driver",
    )

    def loaded():

        return [name for name in job_side if name in sys.modules]

    with RayExecutor(SETTINGS, num_workers=1) as executor:
        assert executor.execute_single(lambda _: loaded()) == []


class _Node:
    """A reference-cycle member that a weakref can watch (a list cannot)."""

    def __init__(self):
        self.me = self


class CycleHolder:
    """An ``executable_cls`` that holds a reference cycle, built after setup's freeze."""

    def __init__(self):
        self.cycle = _Node()


def _collector_state(holder: CycleHolder) -> dict:
    """What a rank's collector froze before user code, and whether it still frees the
    cycles that user code (``executable_cls`` included) drops."""
    import gc
    import weakref

    # Objects the job's side created on the rank (Ray's, this package's) are frozen...
    frozen = gc.get_freeze_count()
    # ...but not the user's: a cycle made here, or by executable_cls, is still freed.
    refs = [weakref.ref(_Node()), weakref.ref(holder.cycle)]
    holder.cycle = None
    gc.collect()
    return {"frozen": frozen, "freed": [ref() is None for ref in refs]}


def test_a_ranks_startup_objects_are_frozen_and_user_cycles_still_freed(ray_4cpu, no_leaks):
    executor = RayExecutor(SETTINGS, num_workers=2)
    executor.start(executable_cls=CycleHolder)
    try:
        states = executor.execute(_collector_state)
    finally:
        executor.stop()
    for state in states:
        # Ray's worker alone holds ~50,000 tracked objects before the first call.
        assert state["frozen"] > 10_000
        assert state["freed"] == [True, True]
