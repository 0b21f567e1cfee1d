"""Job-level restarts of a static job: ``run(..., max_restarts=N)``.

After a failure (a rank raised or died, a node was lost) the whole job is stopped and a
new one started, on whatever nodes Ray places it, after a back-off that doubles each time;
the function runs again from the start. The budget counts for the whole job, not per
node. Inside the function, ``horovod_ray.get_checkpoint()`` gives the latest checkpoint
persisted (with a ``storage_path``), and :func:`attempt` says which attempt this is.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from horovod_ray.errors import HangError, NodeDrainingError, WorkerFailedError

logger = logging.getLogger(__name__)

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


def with_restarts(max_restarts: int, run_attempt: Callable[[int], Any]) -> Any:
    """``run_attempt(n)`` for n = 0, 1, ... until one returns, at most ``max_restarts``
    more times after the first; only a ``WorkerFailedError`` is tried again.

    Raises:
        WorkerFailedError: Every attempt failed; its text lists each attempt's cause, its
            ``failures`` are the last attempt's (without restarts: the error itself).
    """
    causes: list[WorkerFailedError] = []
    for number in range(max_restarts):
        try:
            return run_attempt(number)
        except WorkerFailedError as err:
            causes.append(err)
            wait_s = backoff_s(number)
            logger.warning(
                "attempt %d of the job failed; restarting in %gs (%d restarts left): %s",
                number,
                wait_s,
                max_restarts - number,
                err,
            )
            time.sleep(wait_s)
    try:
        return run_attempt(max_restarts)
    except WorkerFailedError as err:
        if not causes:
            raise  # no restarts asked for: the error as it came
        raise spent([*causes, err]) from err


def spent(causes: list[WorkerFailedError]) -> WorkerFailedError:
    """The error once every attempt failed: each attempt and its cause."""
    attempts = "\n".join(f"--- attempt {n}: {err}" for n, err in enumerate(causes))
    message = (
        f"the job failed {len(causes)} times (max_restarts={len(causes) - 1}); "
        f"each attempt:\n{attempts}"
    )
    last = causes[-1]
    if isinstance(last, HangError):  # what the last attempt was stays visible
        return HangError(last.failures, message, last.missing, last.waiting)
    if isinstance(last, NodeDrainingError):
        return NodeDrainingError(last.failures, message)
    return WorkerFailedError(last.failures, message)
