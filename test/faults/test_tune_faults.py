"""The same failures inside Tune trials: the trial errors with the rank named, and the
trial's workers, rendezvous and placement are gone afterwards."""

from __future__ import annotations

import os
import signal
import time

import pytest
from ray import tune

from horovod_ray.tune import DistributedTrainableCreator
from test.conftest import alive_actors, live_placement_groups, start_local_ray, wait_until

pytestmark = pytest.mark.timeout(300)


def killed_mid_allreduce(config):
    import horovod.torch as hvd
    import torch

    hvd.init()
    for step in range(1000):
        hvd.allreduce(torch.ones(1000))
        if step == 10 and hvd.rank() == config["victim"]:
            os.kill(os.getpid(), signal.SIGKILL)
        if step % 5 == 0:
            tune.report({"step": step})


def never_joins(config):
    if os.environ["HOROVOD_RANK"] == "1":
        time.sleep(3600)
    import horovod.torch as hvd

    hvd.init()
    tune.report({"joined": 1})


@pytest.mark.parametrize(
    "func,kwargs,expected",
    [
        (killed_mid_allreduce, {}, ["WorkerFailedError", "rank 1 failed", "process died"]),
        (never_joins, {"timeout_s": 5}, ["RendezvousError", "rank 1 never joined"]),
    ],
    ids=["sigkill", "never-joins"],
)
def test_trial_failures_name_the_rank_and_release_everything(tmp_path, func, kwargs, expected):
    start_local_ray(4)
    trainable = DistributedTrainableCreator(func, num_hosts=1, num_slots=2, **kwargs)
    started = time.monotonic()
    results = tune.Tuner(
        trainable,
        param_space={"victim": 1},
        run_config=tune.RunConfig(name="faults", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert time.monotonic() - started < 120
    assert results.num_errors == 1
    error = str(results.errors[0])
    for text in expected:
        assert text in error
    assert wait_until(lambda: alive_actors() == [])
    assert wait_until(lambda: live_placement_groups() == [])


def reports_a_dangling_link(config):
    import tempfile
    from pathlib import Path

    import horovod.torch as hvd

    hvd.init()
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "model.bin").symlink_to(Path(directory, "gone"))
        tune.report({"step": 1}, checkpoint=tune.Checkpoint.from_directory(directory))


def test_a_checkpoint_with_a_link_to_nothing_fails_the_trial_saying_so(tmp_path):
    """Links in a checkpoint are followed; one that points nowhere is named, not lost."""
    start_local_ray(4)
    trainable = DistributedTrainableCreator(reports_a_dangling_link, num_hosts=1, num_slots=2)
    results = tune.Tuner(
        trainable,
        run_config=tune.RunConfig(name="dangling", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert results.num_errors == 1
    error = str(results.errors[0])
    for text in ["rank 0 failed", "CheckpointError", "model.bin", "points nowhere"]:
        assert text in error
    assert wait_until(lambda: alive_actors() == [])
