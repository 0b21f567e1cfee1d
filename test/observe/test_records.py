"""The jobs' records in Ray's GCS (``horovod-ray status``): a job whose driver is gone
shows as lost for an hour from when its driver ended, a Tune trial's job too when only
the trial's actor is gone, and the records of ended jobs stay bounded whether anybody
lists them or not. On a real local Ray."""

from __future__ import annotations

import json
import time

import pytest
import ray

from horovod_ray.observe import registry
from horovod_ray.observe.job import JobTelemetry
from test.conftest import run_fresh_python, wait_until

pytestmark = pytest.mark.timeout(120)


def _record(job_id: str, state: str, ray_job_id: str, updated_at: float) -> dict:
    return {
        "id": job_id, "name": "quiet", "kind": "static", "state": state, "ranks_wanted": 2,
        "ranks_alive": 2, "restarts": 0, "resets": 0, "started_at": updated_at - 10,
        "updated_at": updated_at, "ray_job_id": ray_job_id, "driver_pid": 1,
    }  # fmt: skip


def _forget(*job_ids: str) -> None:
    from ray.experimental import internal_kv

    for job_id in job_ids:
        for key in (registry.PREFIX + job_id, registry.PREFIX + job_id + registry.RANK0):
            internal_kv._internal_kv_del(key, namespace=registry.NAMESPACE)


def test_a_quiet_job_that_lost_its_driver_shows_as_lost(ray_4cpu):
    """Its record's last write was two hours ago (it ran quietly), its driver ended just
    now: removed an hour after its last write, it vanished at the next listing, never
    shown as lost."""
    address = ray.get_runtime_context().gcs_address
    code = (
        f"import ray\nray.init(address={address!r})\nprint(ray.get_runtime_context().get_job_id())"
    )
    dead_driver = run_fresh_python(code, timeout_s=60).split()[-1]
    registry.publish("quiet1", _record("quiet1", "running", dead_driver, time.time() - 7200))
    try:
        (job,) = [job for job in registry.jobs(all=True) if job.id == "quiet1"]
        assert (job.state, job.ranks_alive) == ("lost", 0)
    finally:
        _forget("quiet1")


@ray.remote(num_cpus=0)
class _TrialActor:
    """Stands for a Tune trial's actor, which runs a job's driver side."""

    def start(self) -> str:
        self.telemetry = JobTelemetry("trial", "static", metrics=False)
        self.telemetry.state("running")
        return self.telemetry.id


def test_a_killed_trial_actors_job_is_lost_while_tunes_driver_lives(ray_4cpu):
    actor = _TrialActor.remote()
    job_id = ray.get(actor.start.remote())
    try:
        assert [j.state for j in registry.jobs() if j.id == job_id] == ["running"]
        ray.kill(actor)
        assert wait_until(
            lambda: [j.state for j in registry.jobs(all=True) if j.id == job_id] == ["lost"]
        )
        assert job_id not in [job.id for job in registry.jobs()]
    finally:
        _forget(job_id)


def test_ended_records_are_bounded_without_anybody_listing(ray_4cpu, monkeypatch):
    """A long Tune sweep ends a job per trial; each job's start prunes them."""
    monkeypatch.setattr(registry, "MAX_ENDED", 2)
    now = time.time()
    ids = [f"ended{n}" for n in range(4)]
    for n, job_id in enumerate(ids):
        registry.publish(job_id, _record(job_id, "stopped", "01000000", now - 100 + n))
    try:
        registry.prune()
        from ray.experimental import internal_kv

        left = sorted(
            json.loads(internal_kv._internal_kv_get(key, namespace=registry.NAMESPACE))["id"]
            for key in internal_kv._internal_kv_list(registry.PREFIX, namespace=registry.NAMESPACE)
            if key.decode()[len(registry.PREFIX) :] in ids
        )
        assert left == ids[2:]  # the two latest to end
    finally:
        _forget(*ids)
