"""RayExecutor(max_restarts=N): a failed call's job is stopped, a new one started and the
call made again, on a real local Ray with real Horovod collectives (horovod.torch)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

import horovod_ray
from horovod_ray import (
    ConfigError,
    ExecutorState,
    RayExecutor,
    StartCancelledError,
    WorkerFailedError,
)
from horovod_ray.failures import restarts
from test.conftest import assert_two_attempts_spent, ctrl_c_once, wait_until

pytestmark = pytest.mark.timeout(180)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


class _Built:
    """An ``executable_cls``: which attempt built it."""

    def __init__(self) -> None:
        self.attempt = horovod_ray.attempt()


def _rank_1_fails_in(failing: set[int]):
    def step(built: _Built) -> tuple[int, int, int, float]:
        import horovod.torch as hvd
        import torch

        hvd.init()
        total = float(hvd.allreduce(torch.tensor(1.0), op=hvd.Sum))
        if hvd.rank() == 1 and horovod_ray.attempt() in failing:
            raise ValueError(f"bad batch in attempt {horovod_ray.attempt()}")
        return horovod_ray.attempt(), built.attempt, os.getpid(), total

    return step


def test_a_failed_call_runs_again_on_a_new_job_within_the_executors_budget(ray_4cpu, no_leaks):
    executor = RayExecutor(SETTINGS, num_workers=2, max_restarts=1)
    executor.start(executable_cls=_Built)
    try:
        first_pids = set(executor.run(os.getpid))
        assert executor.run(lambda: os.environ["HOROVOD_RAY_ATTEMPT"]) == ["0", "0"]
        job_id = executor.job_id
        results = executor.execute(_rank_1_fails_in({0}))
        # Attempt 1 on every rank, each built again there, on new processes, and their
        # allreduce spans the new world.
        assert [r[:2] for r in results] == [(1, 1), (1, 1)]
        assert not {r[2] for r in results} & first_pids
        assert [r[3] for r in results] == [2.0, 2.0]
        assert executor.state is ExecutorState.RUNNING and executor.job_id == job_id
        (job,) = [job for job in horovod_ray.jobs(all=True) if job.id == job_id]
        assert job.restarts == 1
        # The budget is the executor's: the next failure is the caller's, with each
        # attempt of the job's.
        with pytest.raises(WorkerFailedError) as info:
            executor.execute(_rank_1_fails_in({1}))
        assert_two_attempts_spent(info.value, rank=1)
        assert executor.state is ExecutorState.FAILED
    finally:
        executor.stop()


def test_stop_during_the_back_off_ends_the_job_and_the_call_raises_its_failure(ray_4cpu, no_leaks):
    executor = RayExecutor(SETTINGS, num_workers=2, max_restarts=3)
    executor.start(executable_cls=_Built)
    stopper = threading.Thread(
        target=lambda: (
            wait_until(lambda: executor.state is ExecutorState.STARTING, 60) and executor.stop()
        )
    )
    stopper.start()
    try:
        with pytest.raises(WorkerFailedError, match="bad batch in attempt 0") as info:
            executor.execute(_rank_1_fails_in({0, 1, 2, 3}))
        assert "the job failed" not in str(info.value)  # no second attempt began
    finally:
        stopper.join()
        executor.stop()
    assert executor.state is ExecutorState.STOPPED


def test_ctrl_c_during_the_back_off_ends_the_job_stopped(ray_4cpu, no_leaks):
    executor = RayExecutor(SETTINGS, num_workers=2, max_restarts=3)
    executor.start(executable_cls=_Built)
    with ctrl_c_once() as (interrupt, interrupted):
        presser = threading.Thread(
            target=lambda: (
                wait_until(lambda: executor.state is ExecutorState.STARTING, 60) and interrupt(None)
            )
        )
        presser.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                executor.execute(_rank_1_fails_in({0, 1, 2, 3}))
            assert interrupted.is_set() and executor.state is ExecutorState.STOPPED
        finally:
            presser.join()
            executor.stop()


class _FailsFirst:
    """An ``executable_cls`` that fails in attempt 0, once it has said so in ``folder``."""

    def __init__(self, folder: str) -> None:
        if horovod_ray.attempt() == 0:
            open(os.path.join(folder, f"failed-{os.getpid()}"), "w").close()
            raise ValueError("no dataset in attempt 0")


def test_a_failed_start_is_tried_again_and_stop_during_its_wait_cancels_it(
    ray_4cpu, no_leaks, tmp_path
):
    executor = RayExecutor(SETTINGS, num_workers=2, max_restarts=1)
    executor.start(executable_cls=_FailsFirst, executable_args=[str(tmp_path)])
    try:
        assert executor.run(horovod_ray.attempt) == [1, 1]  # the start's second attempt
    finally:
        executor.stop()
    (tmp_path / "second").mkdir()
    executor = RayExecutor(SETTINGS, num_workers=2, max_restarts=3)
    # stop() once the driver logs the restart, just before its wait: a rank's mark that it
    # failed (its file) came before the driver knew, and a stop() then, under load, cut
    # the first attempt short instead (a cancel without the failure as its cause).
    restarting = _Restarting()
    stopper = threading.Thread(target=lambda: restarting.logged.wait(60) and executor.stop())
    logging.getLogger(restarts.__name__).addHandler(restarting)
    stopper.start()
    try:
        with pytest.raises(StartCancelledError) as info:
            executor.start(executable_cls=_FailsFirst, executable_args=[str(tmp_path / "second")])
        assert "no dataset in attempt 0" in str(info.value.__cause__)
    finally:
        logging.getLogger(restarts.__name__).removeHandler(restarting)
        restarting.logged.set()
        stopper.join()
        executor.stop()
    assert executor.state is ExecutorState.STOPPED
    assert any((tmp_path / "second").iterdir())  # attempt 0 failed in its ranks


class _Restarting(logging.Handler):
    """Sets ``logged`` when the restart loop logs that it will restart."""

    def __init__(self) -> None:
        super().__init__()
        self.logged = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "restarting in" in record.getMessage():
            self.logged.set()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_workers": 2, "max_restarts": -1}, "max_restarts must be an integer >= 0"),
        ({"num_workers": 2, "max_restarts": 1.5}, "max_restarts must be an integer >= 0"),
        ({"min_workers": 1, "max_restarts": 1}, "an elastic job recovers in place"),
    ],
)
def test_a_bad_max_restarts_is_refused_when_the_executor_is_made(kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        RayExecutor(SETTINGS, **kwargs)
    assert info.value.parameter == "max_restarts"
