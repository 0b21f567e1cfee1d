"""Job-level restarts, one policy for every entry point.

After a failure (a rank raised or died, a node was lost) the whole job is stopped and a
new one started, on whatever nodes Ray places it, after a back-off that doubles each time;
the function runs again from the start. The budget counts for the whole job, not per
node. Inside the function, ``horovod_ray.get_checkpoint()`` gives the latest checkpoint
persisted (with a ``storage_path``), and :func:`attempt` says which attempt this is.

:class:`RestartPolicy` decides (``decide``: a pure function of the failure and the
attempt); :func:`attempts` is the one loop that ``run()``, ``RayExecutor`` (its calls)
and ``horovod-ray run`` share, each with its own way to wait and to say so.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import time
from typing import Callable, TypeVar

from horovod_ray.errors import ConfigError, HangError, NodeDrainingError, WorkerFailedError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Set on every rank: the attempt its job is (0 first).
ATTEMPT_ENV = "HOROVOD_RAY_ATTEMPT"
# The first wait before a restart, doubled for each one after, at most the second.
BACKOFF_S = (1.0, 60.0)


def attempt() -> int:
    """Which attempt of its job this rank runs in: 0 first, then 1, 2, ... after each
    restart of ``run(..., max_restarts=N)``. Outside such a job, 0."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def backoff_s(restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (0 first)."""
    first, most = BACKOFF_S
    return min(most, first * 2**restart)


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """When a failed job runs again.

    Attributes:
        max_restarts: How many times a job may run again after its first attempt; only a
            ``WorkerFailedError`` (a rank raised or died, a hang, a drained node) is tried
            again, never a bad argument, a placement timeout or Ctrl-C.

    Raises:
        ConfigError: ``max_restarts`` is not an integer >= 0.
    """

    max_restarts: int = 0

    def __post_init__(self) -> None:
        count = self.max_restarts
        if not isinstance(count, numbers.Integral) or isinstance(count, bool) or count < 0:
            raise ConfigError(
                "max_restarts",
                f"max_restarts must be an integer >= 0, got {self.max_restarts!r}",
            )

    def decide(self, failure: BaseException, attempt: int) -> float | None:
        """Seconds to wait before attempt ``attempt + 1`` after attempt ``attempt`` (0
        first) failed with ``failure``; None: no restart, ``failure`` is raised."""
        if not isinstance(failure, WorkerFailedError) or attempt >= self.max_restarts:
            return None
        return backoff_s(attempt)

    def left(self, attempt: int) -> int:
        """Restarts left once attempt ``attempt`` failed and another begins."""
        return self.max_restarts - attempt


def _sleep(seconds: float) -> bool:
    time.sleep(seconds)
    return True


def _log_restart(number: int, failure: BaseException, wait_s: float, left: int) -> None:
    logger.warning(
        "attempt %d of the job failed; restarting in %gs (%d restarts left): %s",
        number,
        wait_s,
        left,
        failure,
    )


def attempts(
    policy: RestartPolicy,
    run_attempt: Callable[[int], T],
    *,
    first: int = 0,
    wait: Callable[[float], bool] = _sleep,
    on_restart: Callable[[int, BaseException, float, int], None] = _log_restart,
    causes: list[WorkerFailedError] | None = None,
) -> T:
    """``run_attempt(n)`` for n = ``first``, ``first + 1``, ... until one returns or
    ``policy.decide`` says no more: then the failure is raised.

    Args:
        policy: Decides after each failure.
        run_attempt: Runs attempt ``n``.
        first: The first attempt's number (a job whose earlier calls spent some).
        wait: Waits the seconds before the next attempt; False when it was cut short (a
            signal, a stop()): no more attempts, the failure is raised.
        on_restart: Told (attempt that failed, its failure, seconds to wait, restarts
            left) before each wait.
        causes: The failures of the job's attempts before ``first``, which this loop
            adds to (a job whose start and calls each loop: the last error lists them
            all); None: none.

    Raises:
        WorkerFailedError: The attempts are spent: after restarts its text lists each
            attempt's cause (:func:`spent`); else the failure as it came. Anything else an
            attempt raised, as it came.
    """
    causes = [] if causes is None else causes
    number = first
    while True:
        try:
            return run_attempt(number)
        except BaseException as err:
            wait_s = policy.decide(err, number)
            if wait_s is None:
                if causes and isinstance(err, WorkerFailedError):
                    every = [*causes, err]
                    raise spent(every, policy.max_restarts, number + 1 - len(every)) from err
                raise
            causes.append(err)  # decide() retries only a WorkerFailedError
            on_restart(number, err, wait_s, policy.left(number))
            if not wait(wait_s):
                if len(causes) == 1:
                    raise
                raise spent(causes, policy.max_restarts, number + 1 - len(causes)) from err
        number += 1


def spent(
    causes: list[WorkerFailedError], max_restarts: int | None = None, first: int = 0
) -> WorkerFailedError:
    """The error once every attempt failed: each attempt (numbered from ``first``) and its
    cause; ``max_restarts``: the budget, by default one less than the attempts."""
    if max_restarts is None:
        max_restarts = len(causes) - 1
    attempts_text = "\n".join(f"--- attempt {n}: {err}" for n, err in enumerate(causes, first))
    message = (
        f"the job failed {len(causes)} times (max_restarts={max_restarts}); "
        f"each attempt:\n{attempts_text}"
    )
    last = causes[-1]
    if isinstance(last, HangError):  # what the last attempt was stays visible
        return HangError(last.failures, message, last.missing, last.waiting)
    if isinstance(last, NodeDrainingError):
        return NodeDrainingError(last.failures, message)
    return WorkerFailedError(last.failures, message)
