"""The one restart policy and its attempts loop, without Ray."""

from __future__ import annotations

import logging

import pytest

from horovod_ray.errors import (
    ConfigError,
    HangError,
    NodeDrainingError,
    PlacementTimeoutError,
    WorkerFailedError,
)
from horovod_ray.failures.restarts import RestartPolicy, attempts
from horovod_ray.job.lifecycle import Cancel, ExecutorState, Lifecycle
from horovod_ray.job.restarting import Restarts

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)

FAILED = WorkerFailedError({1: "rank 1 died"})
HUNG = HangError({0: "stacks"}, "ranks hung", [0], [1])
DRAINED = NodeDrainingError({0: "drained"}, "node drained")


@pytest.mark.parametrize(
    "max_restarts, failure, attempt, wait_s",
    [
        (0, FAILED, 0, None),  # no budget: raised as it came
        (2, FAILED, 0, 1.0),  # the back-off doubles ...
        (2, FAILED, 1, 2.0),
        (2, FAILED, 2, None),  # ... until the budget is spent
        (10, FAILED, 9, 60.0),  # at most 60 s
        (1, HUNG, 0, 1.0),  # a hang and a drained node are a rank's failure too
        (1, DRAINED, 0, 1.0),
        (5, ConfigError("x", "bad x"), 0, None),  # never a bad argument,
        (5, PlacementTimeoutError("no room"), 0, None),  # a cluster without room,
        (5, KeyboardInterrupt(), 0, None),  # or Ctrl-C
        (5, ValueError("a bug"), 0, None),
    ],
)
def test_decide_restarts_only_a_failed_rank_within_the_budget(
    max_restarts, failure, attempt, wait_s
):
    assert RestartPolicy(max_restarts).decide(failure, attempt) == wait_s


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_a_bad_max_restarts_names_the_parameter(bad):
    with pytest.raises(ConfigError, match="max_restarts must be an integer >= 0") as info:
        RestartPolicy(bad)
    assert info.value.parameter == "max_restarts"


class _Attempts:
    """Fails with ``failures[n]`` at attempt n, returns "done" after them; records waits."""

    def __init__(self, *failures: BaseException, cut_at: int | None = None) -> None:
        self.failures = failures
        self.numbers: list[int] = []
        self.waits: list[float] = []
        self.told: list[tuple[int, float, int]] = []
        self.cut_at = cut_at

    def __call__(self, number: int) -> str:
        self.numbers.append(number)
        index = len(self.numbers) - 1
        if index < len(self.failures):
            raise self.failures[index]
        return "done"

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return len(self.waits) != self.cut_at

    def tell(self, number: int, failure: BaseException, wait_s: float, left: int) -> None:
        self.told.append((number, wait_s, left))


def _loop(policy: RestartPolicy, run: _Attempts, first: int = 0) -> str:
    return attempts(policy, run, first=first, wait=run.wait, on_restart=run.tell)


def test_attempts_go_on_until_one_returns():
    run = _Attempts(FAILED, FAILED)
    assert _loop(RestartPolicy(2), run) == "done"
    assert (run.numbers, run.waits, run.told) == ([0, 1, 2], [1.0, 2.0], [(0, 1.0, 2), (1, 2.0, 1)])


def test_spent_attempts_raise_each_cause_and_keep_the_last_kind():
    run = _Attempts(FAILED, HUNG)
    with pytest.raises(HangError) as info:
        _loop(RestartPolicy(1), run)
    text = str(info.value)
    assert text.startswith("the job failed 2 times (max_restarts=1); each attempt:")
    assert "--- attempt 0: Horovod rank 1 failed" in text and "--- attempt 1: ranks hung" in text
    assert list(info.value.missing) == [0] and run.numbers == [0, 1]


def test_without_restarts_the_failure_comes_as_it_was():
    run = _Attempts(FAILED)
    with pytest.raises(WorkerFailedError) as info:
        _loop(RestartPolicy(0), run)
    assert info.value is FAILED and run.waits == []


def test_what_is_not_a_rank_failure_ends_the_attempts_as_it_came():
    error = PlacementTimeoutError("no room")
    run = _Attempts(FAILED, error)
    with pytest.raises(PlacementTimeoutError) as info:
        _loop(RestartPolicy(3), run)
    assert info.value is error and run.numbers == [0, 1]


def test_a_wait_cut_short_ends_the_attempts_with_the_failure():
    run = _Attempts(FAILED, FAILED, cut_at=1)
    with pytest.raises(WorkerFailedError) as info:
        _loop(RestartPolicy(5), run)
    assert info.value is FAILED and run.numbers == [0]  # no attempt after the cut


def test_a_later_first_attempt_spends_the_rest_of_the_budget():
    run = _Attempts(FAILED, FAILED)
    with pytest.raises(WorkerFailedError, match=r"failed 2 times \(max_restarts=3\)") as info:
        _loop(RestartPolicy(3), run, first=2)
    assert "--- attempt 2: " in str(info.value) and "--- attempt 3: " in str(info.value)
    assert run.numbers == [2, 3] and run.told == [(2, 4.0, 1)]


class _RaisesAsTheRestartIsSaid(logging.Handler):
    """Raises ``error`` where the restart is logged: after the failed attempt was released
    (the job STARTING), before the wait."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def emit(self, record: logging.LogRecord) -> None:
        raise self.error


@pytest.mark.parametrize(
    "error, final",
    [
        (KeyboardInterrupt(), ExecutorState.STOPPED),
        (RuntimeError("disk full"), ExecutorState.FAILED),
    ],
)
def test_what_ends_the_loop_between_attempts_ends_the_job(error, final):
    lifecycle = Lifecycle(initial=ExecutorState.STARTING)  # as a failed call leaves it
    job, released = Restarts(1, False, lifecycle, Cancel()), []
    logger = logging.getLogger("horovod_ray.failures.restarts")
    handler = _RaisesAsTheRestartIsSaid(error)
    logger.addHandler(handler)
    try:
        with pytest.raises(type(error)):
            job.loop(_Attempts(FAILED), lambda: released.append(True))
    finally:
        logger.removeHandler(handler)
    # Not left STARTING, where a stop() waits 30 s for a start that never comes.
    assert lifecycle.state is final and released == [True]
