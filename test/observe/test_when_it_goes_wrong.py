"""What observing a job must never do: keep it from being released, stop a rank's
metrics for good, or take an old run's folder; on real Ray where it takes Ray."""

from __future__ import annotations

import logging
import time

import pytest

import horovod_ray
from horovod_ray import RayExecutor
from test.conftest import alive_actors


def _one_allreduce():
    import horovod.torch as hvd
    import torch

    hvd.init()
    return float(hvd.allreduce(torch.ones(1), name="one"))


def test_a_timeline_that_cannot_be_written_still_releases_the_job(no_leaks, caplog):
    caplog.set_level(logging.WARNING, logger="horovod_ray.job.static")
    # A folder under a file: the driver cannot create it.
    settings = RayExecutor.create_settings(timeline="/dev/null/timeline.json")
    with RayExecutor(settings, num_workers=2) as executor:
        assert executor.run(_one_allreduce) == [1.0, 1.0]
    assert "horovod's timeline was not written to /dev/null/timeline.json" in caplog.text
    assert alive_actors() == []  # released all the same (no_leaks checks the group too)


def test_run_writes_the_timeline_where_it_is_asked(ray_4cpu, tmp_path):
    path = tmp_path / "deep" / "timeline.json"
    assert horovod_ray.run(_one_allreduce, num_slots=2, timeline=str(path)) == [1.0, 1.0]
    assert b"allreduce.one" in path.read_bytes()


@pytest.mark.unit
def test_a_sampler_that_fails_once_goes_on(monkeypatch):
    from horovod_ray.rank import metrics

    monkeypatch.setattr(metrics, "INTERVAL_S", 0.01)
    calls = []

    def sample(self):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ConnectionError("the GCS is away")

    monkeypatch.setattr(metrics.RankTelemetry, "sample", sample)
    metrics.RankTelemetry("job", "id", "127.0.0.1", values=False)
    deadline = time.monotonic() + 5
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) >= 3


@pytest.mark.unit
def test_a_command_lines_storage_run_without_a_name_gets_a_new_folder():
    """Not the script's name, which would resume an older run's checkpoints."""
    from horovod_ray.cli.main import _build_executor
    from horovod_ray.cli.parser import build_parser

    argv = ["run", "-np", "2", "--storage-path", "/tmp/runs", "python", "train.py"]
    executor = _build_executor(build_parser().parse_args(argv))
    assert executor.settings.storage.name.startswith("horovod_ray_")  # the time's
    assert executor.settings.name == executor.settings.storage.name
    plain = _build_executor(build_parser().parse_args(["run", "-np", "2", "python", "t.py"]))
    assert (plain.settings.name, plain.settings.storage) == ("t.py", None)
