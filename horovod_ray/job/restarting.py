"""A static job's restarts (``RayExecutor(..., max_restarts=N)``): which attempt runs, the
causes of those that failed, start()'s inputs for the next, and how the next one is made,
brought up and waited for. What to do after a failure is ``failures.restarts``' policy
and loop; the executor says when (its start, its calls)."""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

from horovod_ray.errors import ConfigError, StartCancelledError, WorkerFailedError
from horovod_ray.failures import restarts
from horovod_ray.job.attempt import JobAttempt
from horovod_ray.job.lifecycle import Cancel, ExecutorState, Lifecycle
from horovod_ray.observe.job import JobTelemetry

T = TypeVar("T")
logger = logging.getLogger(__name__)


class Restarts:
    """One executor's attempts.

    Args:
        max_restarts: The executor's budget (``RestartPolicy``).
        elastic: Whether the job is elastic (which recovers in place: no restarts).
        lifecycle: The executor's; a restart moves it from STARTING.
        cancel: Set by stop(): the wait before a restart gives up.

    Raises:
        ConfigError: A bad ``max_restarts``, or one for an elastic job.
    """

    def __init__(
        self, max_restarts: int, elastic: bool, lifecycle: Lifecycle, cancel: Cancel
    ) -> None:
        self.policy = restarts.RestartPolicy(max_restarts)
        if max_restarts and elastic:
            raise ConfigError(
                "max_restarts",
                "an elastic job recovers in place (its survivors reset): max_restarts is "
                "for static jobs; drop it, or give num_workers/num_hosts instead of min_workers",
            )
        self.number = 0  # the attempt that runs (0 until a restart)
        self._causes: list[WorkerFailedError] = []  # each failed attempt's, for the last error
        self._inputs: tuple[dict[str, str], bytes | None] = ({}, None)
        self._lifecycle = lifecycle
        self._cancel = cancel

    def keep(self, env: dict[str, str], executable: bytes | None) -> None:
        """start()'s inputs, for each restart; attempt 0's ranks are told so."""
        self._inputs = (dict(env), executable)
        if self.policy.max_restarts:
            env[restarts.ATTEMPT_ENV] = "0"  # not one a node's environment may hold

    def again(self, failure: BaseException, number: int) -> bool:
        """Whether attempt ``number``'s ``failure`` is followed by another attempt."""
        return not self._cancel.is_set() and self.policy.decide(failure, number) is not None

    def bring_up(
        self, now: JobAttempt, number: int, env: dict[str, str], executable: bytes | None
    ) -> None:
        """Attempt ``number`` up, from STARTING (STARTING kept when it is tried again)."""
        now.bring_up(
            self._lifecycle, self._cancel, env, executable, lambda err: self.again(err, number)
        )

    def restart(
        self,
        number: int,
        telemetry: JobTelemetry,
        make: Callable[[JobTelemetry], JobAttempt],
        install: Callable[[JobAttempt], None],
    ) -> None:
        """Attempt ``number``, from STARTING (the failed one's ranks were released): a new
        attempt made with the job's ``telemetry`` (the checkpoint to resume from, a new
        split of the datasets), ``install``-ed as the job's, then started as start() did."""
        self.number = number
        env, executable = self._inputs
        env = {**env, restarts.ATTEMPT_ENV: str(number)}
        try:
            now = make(telemetry)
            install(now)
            telemetry.restarted()
            now.prepare(env)
        except BaseException as err:  # noqa: BLE001 - fail_start re-raises it
            self._lifecycle.fail_start(err, lambda: None, self._cancel.is_set())
        self.bring_up(now, number, env, executable)

    def loop(
        self, run_attempt: Callable[[int], T], release: Callable[[], None], start: bool = False
    ) -> T:
        """``restarts.attempts`` from the attempt that runs, with this job's causes and a
        wait that stop() cuts short; for ``start``, that cut raises StartCancelledError.

        Whatever ends the loop between a failed attempt and the next one's bring-up (a
        Ctrl-C there, as in the wait) ends the job as the wait's cut does: ``release()``
        (the last attempt's ranks, released already: a no-op) and STOPPED (FAILED for an
        error that is no interrupt), never a job left STARTING that nothing will start.
        """
        try:
            return restarts.attempts(
                self.policy, run_attempt, first=self.number, wait=self._wait, causes=self._causes
            )
        except WorkerFailedError as err:
            if start and self._cancel.is_set():  # stop() cut the wait before a new attempt
                raise StartCancelledError() from err
            self._end_between(err, release)
            raise
        except BaseException as err:
            self._end_between(err, release)
            raise

    def _end_between(self, err: BaseException, release: Callable[[], None]) -> None:
        """Ends a job the loop left STARTING; a release that fails then is logged, so
        that the caller still sees ``err``, what ended the loop."""
        if self._lifecycle.state is ExecutorState.STARTING:
            interrupted = self._cancel.is_set() or isinstance(err, KeyboardInterrupt)
            try:
                self._lifecycle.finish_start(release, cancelled=interrupted)
            except Exception:  # noqa: BLE001 - err is what the caller is told
                logger.warning("releasing the job after %r failed", err, exc_info=True)

    def _wait(self, seconds: float) -> bool:
        """The back-off before a restart, cut short by stop(): then the job ends STOPPED
        (stop() waits for that) and False says no restart."""
        try:
            if not self._cancel.wait(seconds):
                return True
        except BaseException:  # Ctrl-C: the job is released already, and ends here
            self._lifecycle.finish_start(lambda: None, cancelled=True)
            raise
        self._lifecycle.finish_start(lambda: None, cancelled=True)
        return False
