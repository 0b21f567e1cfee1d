"""The driver's side of a run's validations (see ``validation``): a thread that finds
the requests in the run's markers and runs each as a Ray task, or with ``run(local=True)``
as a thread of the calling process, then records its outcome."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from horovod_ray.checkpoints import store
from horovod_ray.checkpoints.choices import PENDING_VALIDATION
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.checkpoints.validation import (
    FAILED,
    POLL_S,
    TIMED_OUT,
    VALIDATED,
    WARN_S,
    Validation,
    record,
    task_inputs,
    validate,
)
from horovod_ray.checkpoints.validation import remote as _remote

logger = logging.getLogger(__name__)

# Longest cancel() waits for the driver's thread.
STOP_S = 10.0

# An outcome: status, metrics, error.
Outcome = tuple[str, dict, "str | None"]


class Validator:
    """The driver's side of a run's validations: a thread that finds the requests in the
    run's markers and runs them, oldest first, one at a time, as Ray tasks (with
    ``in_process``, as threads of this process: ``run(local=True)``'s)."""

    def __init__(
        self,
        storage: RunStorage,
        validation: Validation,
        in_process: bool = False,
        poll_s: float = POLL_S,
    ) -> None:
        self.storage = storage
        self._validation = validation
        self._in_process = in_process
        self._poll_s = poll_s
        self._settled: set[int] = set()  # committed, with no validation pending
        self._lock = threading.Lock()  # _running, against cancel()
        self._running: _Running | None = None
        self._outcome: tuple[_Running, Outcome] | None = None  # not yet recorded
        self._draining = threading.Event()
        self._stop = threading.Event()
        self._remote: Any = None
        self._fn: Any = validation.fn
        self._thread = threading.Thread(
            target=self._loop, name="horovod_ray-validation", daemon=True
        )

    def start(self) -> None:
        if not self._in_process:
            import ray

            self._remote = _remote(self._validation.remote_kwargs)
            self._fn = ray.put(self._validation.fn)  # pickled once, for every task
        self._thread.start()

    def finish(self) -> None:
        """Waits until every validation asked for so far has ended and is recorded (a
        storage that fails then leaves the rest pending, logged), then stops. Ctrl-C
        cancels as :meth:`cancel`."""
        self._draining.set()
        try:
            while self._thread.is_alive():
                self._thread.join(0.2)
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stops now: the validation under way is cancelled and its checkpoint stays
        pending, for the next job with this storage."""
        self._stop.set()  # before the lock too: a Ctrl-C waiting for it leaves it set
        with self._lock:
            self._stop.set()  # no task starts once this is set
            running, self._running = self._running, None
        if running is not None:
            running.task.cancel()
            logger.info("checkpoint %d's validation was cancelled: it stays pending", running.index)
        if self._thread.is_alive():
            self._thread.join(STOP_S)  # a storage call under way may outlast it: logged
            if self._thread.is_alive():
                logger.warning("the validation thread did not stop within %gs", STOP_S)

    def _loop(self) -> None:
        warned = None
        while not self._stop.is_set():
            draining = self._draining.is_set()  # before the step: it sees every commit
            try:
                idle = self._step()
            except Exception as err:  # noqa: BLE001 - a storage's error: tried again
                if draining:
                    logger.warning("validations are left pending: %s", err)
                    return
                if str(err) != warned:
                    warned = str(err)
                    logger.warning("validations wait, the storage failed: %s", err)
                idle = False
            if idle and draining:
                return
            self._stop.wait(self._poll_s)

    def _step(self) -> bool:
        """One look: the outcome of the validation under way recorded, the next one
        started. Whether none is pending or under way."""
        running = self._running
        if running is not None:
            outcome = running.task.outcome()
            if outcome is None:
                running.warn_if_long()
                return False
            with self._lock:
                if self._stop.is_set():
                    return False  # cancelled meanwhile: it stays pending
                self._running, self._outcome = None, (running, outcome)
        if self._outcome is not None:
            done, (status, metrics, error) = self._outcome
            recorded = record(
                self.storage, done.index, status, metrics, error, written=done.written
            )
            self._outcome = None  # a failure above raises first: recorded on the next look
            if recorded:
                self._settled.add(done.index)
                logger.info("checkpoint %d: %s %s", done.index, status, error or metrics)
            # Else the next listing settles it, or finds another checkpoint pending there
            # (two processes committed that number: see store.commit).
        entries = store.list_entries(self.storage, skip=self._settled)
        self._settled.update(
            e.index for e in entries if e.committed and e.status != PENDING_VALIDATION
        )
        pending = [e for e in entries if e.status == PENDING_VALIDATION]
        if not pending:
            return True
        entry = pending[0]
        kwargs, timeout_s = task_inputs(self._validation, entry.validation.get("request") or {})
        checkpoint = store.as_checkpoint(self.storage, entry)
        kind = _ThreadTask if self._in_process else _RayTask
        with self._lock:
            if self._stop.is_set():
                return False
            task = kind(self._remote, self._fn, kwargs, checkpoint, timeout_s)
            self._running = _Running(entry.index, entry.time, task, time.monotonic())
        logger.info("validating checkpoint %d", entry.index)
        return False


@dataclasses.dataclass
class _Running:
    """The validation under way: its checkpoint's number and marker's time, its task."""

    index: int
    written: Any
    task: _RayTask | _ThreadTask
    began: float
    warned_at: float = 0.0

    def warn_if_long(self) -> None:
        """Every ``WARN_S``: a validation that long may be waiting for resources that the
        ranks hold (a Ray task takes 1 CPU unless ``ray_remote_kwargs`` says otherwise)."""
        waited = time.monotonic() - self.began
        if waited - self.warned_at >= WARN_S:
            self.warned_at = waited
            logger.warning(
                "checkpoint %d's validation has not ended after %.0fs: it may be waiting "
                "for its ray_remote_kwargs' resources (1 CPU by default), which the ranks "
                "may hold until the job ends",
                self.index,
                waited,
            )


class _RayTask:
    """One validation as a Ray task."""

    def __init__(
        self, remote: Any, fn: Any, kwargs: dict, checkpoint: Any, timeout_s: float | None
    ) -> None:
        self._ref = remote.remote(fn, kwargs, checkpoint)
        self._began = time.monotonic()
        self._timeout_s = timeout_s

    def outcome(self) -> Outcome | None:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        if ready:
            try:
                return VALIDATED, ray.get(self._ref), None
            except Exception as err:  # noqa: BLE001 - the function's failure, recorded
                cause = getattr(err, "cause", None) or err
                logger.error("a checkpoint's validation failed: %s", err)
                return FAILED, {}, f"{type(cause).__name__}: {cause}"
        if self._timeout_s is not None and time.monotonic() - self._began > self._timeout_s:
            self.cancel()
            return TIMED_OUT, {}, f"took longer than timeout_s={self._timeout_s}"
        return None

    def cancel(self) -> None:
        import ray

        try:
            ray.cancel(self._ref, force=True)
        except Exception as err:  # noqa: BLE001 - it may have ended meanwhile
            logger.debug("cancelling a validation: %s", err)


class _ThreadTask:
    """One validation in a thread of this process (``run(local=True)``: a debugger's
    breakpoint in the function works). A thread cannot be stopped: one past its time
    limit is recorded as timed out and left to end on its own."""

    def __init__(
        self, remote: Any, fn: Any, kwargs: dict, checkpoint: Any, timeout_s: float | None
    ) -> None:
        self._result: Outcome | None = None
        self._began = time.monotonic()
        self._timeout_s = timeout_s
        self._done = threading.Event()
        threading.Thread(
            target=self._run,
            args=(fn, kwargs, checkpoint),
            name="horovod_ray-validate",
            daemon=True,
        ).start()

    def _run(self, fn: Callable[..., Any], kwargs: dict, checkpoint: Any) -> None:
        try:
            self._result = VALIDATED, validate(fn, kwargs, checkpoint), None
        except BaseException as err:  # noqa: BLE001 - the function's failure, recorded
            # sys.exit() too: it ends only this thread, and a Ray task's is a failure.
            logger.exception("a checkpoint's validation failed")
            self._result = FAILED, {}, f"{type(err).__name__}: {err}"
        finally:
            self._done.set()

    def outcome(self) -> Outcome | None:
        if self._done.is_set():
            return self._result
        if self._timeout_s is not None and time.monotonic() - self._began > self._timeout_s:
            return TIMED_OUT, {}, f"took longer than timeout_s={self._timeout_s}"
        return None

    def cancel(self) -> None:
        pass  # it ends on its own; its outcome is no longer recorded
