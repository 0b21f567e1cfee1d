"""``report(validation=...)``: Ray Train's checkpoint validation (Ray 2.60, alpha) in a
run with a storage path.

The run's ``ray.train.ValidationConfig(fn=...)`` stays on the driver. A rank 0 report
that asks for a validation has its request (``fn_kwargs``, ``timeout_s``) written into
the checkpoint's marker, as pending, when the checkpoint is committed. The driver's
:class:`Validator` finds such markers and runs ``fn(checkpoint, **fn_kwargs)`` as a Ray
task, one at a time and oldest first (as Ray Train does). It writes the outcome into the
marker:

* ``VALIDATED``: the metrics ``fn`` returned are merged into the checkpoint's;
* ``VALIDATION_FAILED`` or ``VALIDATION_TIMEOUT``: the metrics stay as they were.

The marker is the record, so:

* the keep policy never removes a checkpoint pending validation;
* a job that fails leaves its pending validations to the next job with the same
  storage path, as Ray Train requeues them;
* ``get_all_reported_checkpoints()`` reads each checkpoint's status there.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

from horovod_ray.checkpoints import store
from horovod_ray.checkpoints.choices import PENDING_VALIDATION, Entry, folder_name
from horovod_ray.checkpoints.files import failed, read_json, storage_errors, write_json
from horovod_ray.checkpoints.metrics import checked_metrics, encoded, plain
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import ConfigError

logger = logging.getLogger(__name__)

# Set on every rank of a job whose run has a ValidationConfig: report(validation=...)
# is refused without it, as Ray Train refuses it without the trainer's.
VALIDATION_ENV = "HOROVOD_RAY_VALIDATION"
VALIDATED = "VALIDATED"
FAILED = "VALIDATION_FAILED"
TIMED_OUT = "VALIDATION_TIMEOUT"
# How often the driver looks for new requests, and a rank for their outcomes (Ray
# Train polls its validation tasks every second).
POLL_S = 1.0


@dataclasses.dataclass(frozen=True)
class Validation:
    """A run's ``ValidationConfig``, checked.

    Attributes:
        fn: ``fn(checkpoint, **fn_kwargs) -> dict`` of metrics.
        fn_kwargs: The default keyword arguments (JSON values).
        timeout_s: The default limit on one validation; None: none.
        remote_kwargs: ``ray.remote``'s options for the task (``num_cpus``, ...).
    """

    fn: Callable[..., Any]
    fn_kwargs: dict
    timeout_s: float | None
    remote_kwargs: dict


def check_config(config: Any) -> Validation | None:
    """A ``ray.train.ValidationConfig`` checked, before Ray is touched; None for None.

    Raises:
        ConfigError: Naming ``validation_config`` and what is wrong with it.
    """
    if config is None:
        return None
    if not all(hasattr(config, field) for field in ("fn", "task_config", "ray_remote_kwargs")):
        raise ConfigError(
            "validation_config",
            f"validation_config must be a ray.train.ValidationConfig(fn=...), got "
            f"{type(config).__name__}",
        )
    if not callable(config.fn):
        raise ConfigError(
            "validation_config",
            f"validation_config.fn must be a function (checkpoint, **fn_kwargs) -> dict of "
            f"metrics, got {config.fn!r}",
        )
    fn_kwargs, timeout_s = _task_fields(config.task_config, "validation_config.task_config")
    remote_kwargs = config.ray_remote_kwargs or {}
    try:
        import cloudpickle

        cloudpickle.dumps(config.fn)  # now, not when the first validation is due
    except Exception as err:
        raise ConfigError(
            "validation_config",
            f"validation_config.fn cannot be pickled to run as a Ray task: "
            f"{type(err).__name__}: {err}",
        ) from err
    try:
        _remote(remote_kwargs)  # Ray checks the options' names and values
    except (TypeError, ValueError) as err:
        raise ConfigError(
            "validation_config",
            f"validation_config.ray_remote_kwargs are not ray.remote's options: {err}",
        ) from err
    return Validation(config.fn, fn_kwargs or {}, timeout_s, dict(remote_kwargs))


def task_request(validation: Any, has_checkpoint: bool, configured: bool) -> dict | None:
    """``report(validation=...)`` as the request its marker records: None for False,
    {} for True (the run's defaults), ``fn_kwargs`` and ``timeout_s`` for a
    ``ValidationTaskConfig``. Pure.

    Raises:
        ConfigError: Naming ``validation``: a value of another kind, no checkpoint, a
            run without a ``ValidationConfig`` (``configured`` False), or ``fn_kwargs``
            that JSON cannot hold.
    """
    if validation is False or validation is None:
        return None
    if validation is not True and not hasattr(validation, "fn_kwargs"):
        raise ConfigError(
            "validation",
            f"validation must be True, False or a ray.train.ValidationTaskConfig, got "
            f"{validation!r}",
        )
    if not has_checkpoint:
        raise ConfigError("validation", "report(validation=...) needs a checkpoint to validate")
    if not configured:
        raise ConfigError(
            "validation",
            "report(validation=...) needs the run's ValidationConfig: give run(..., "
            "validation_config=ray.train.ValidationConfig(fn=...)) or create_settings("
            "validation_config=...) (the command line takes none)",
        )
    if validation is True:
        return {}
    fn_kwargs, timeout_s = _task_fields(validation, "validation")
    return {"fn_kwargs": fn_kwargs, "timeout_s": timeout_s}


def _task_fields(config: Any, name: str) -> tuple[dict, float | None]:
    """A ``ValidationTaskConfig``'s ``fn_kwargs`` and ``timeout_s``, checked."""
    parameter = name.partition(".")[0]
    fn_kwargs = getattr(config, "fn_kwargs", None) or {}
    timeout_s = getattr(config, "timeout_s", None)
    if not isinstance(fn_kwargs, dict) or not all(isinstance(key, str) for key in fn_kwargs):
        raise ConfigError(
            parameter, f"{name}.fn_kwargs must be a dict keyed by str, got {fn_kwargs!r}"
        )
    try:
        json.dumps(fn_kwargs)  # the marker holds them, as Ray Train's snapshot does
    except (TypeError, ValueError) as err:
        raise ConfigError(
            parameter,
            f"{name}.fn_kwargs must be JSON values (numbers, str, lists, dicts): {err}; pass "
            f"anything larger through the checkpoint or the function",
        ) from err
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
    ):
        raise ConfigError(parameter, f"{name}.timeout_s must be None or > 0, got {timeout_s!r}")
    return fn_kwargs, timeout_s


def task_inputs(validation: Validation, request: dict) -> tuple[dict, float | None]:
    """The keyword arguments and time limit for one validation: the run's defaults, with
    the report's over them (its ``timeout_s`` wins even when None, as in Ray Train).
    Pure."""
    kwargs = {**validation.fn_kwargs, **(request.get("fn_kwargs") or {})}
    return kwargs, request["timeout_s"] if "timeout_s" in request else validation.timeout_s


def validate(fn: Callable[..., Any], kwargs: dict, checkpoint: Any) -> dict:
    """Runs ``fn(checkpoint, **kwargs)`` (a Ray task's body): its metrics, as stored.

    Raises:
        ValueError: ``fn`` returned something else than a dict keyed by str.
    """
    metrics = fn(checkpoint, **kwargs)
    if not isinstance(metrics, dict):
        raise ValueError(
            f"the validation function must return a dict of metrics, got {type(metrics).__name__}"
        )
    return plain(checked_metrics(metrics))


def record(
    storage: RunStorage, index: int, status: str, metrics: dict, error: str | None = None
) -> bool:
    """Writes a validation's outcome into checkpoint ``index``'s marker: ``status``, the
    ``error`` of one that failed, and ``metrics`` merged into the checkpoint's (over
    those of the same name). Whether the checkpoint was still there to take it.

    Raises:
        CheckpointError: The storage could not be read or written.
    """
    name = f"{folder_name(index)}.json"
    marker = read_json(storage, name)
    if not isinstance(marker, dict) or not isinstance(marker.get("metrics"), dict):
        return False
    outcome = dict(marker.get("validation") or {}, status=status)
    if error is not None:
        outcome["error"] = error
    marker = {**marker, "metrics": {**marker["metrics"], **metrics}, "validation": outcome}
    try:
        write_json(storage, name, encoded(marker))
    except storage_errors() as err:
        raise failed("write", f"{storage.run_path}/{name}", err) from err
    return True


def _remote(remote_kwargs: dict) -> Any:
    import ray

    task = ray.remote(validate)
    return task.options(**remote_kwargs) if remote_kwargs else task


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
        self._running: tuple[Entry, _RayTask | _ThreadTask] | None = None
        self._outcome: tuple[Entry, Outcome] | None = None  # not yet recorded
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
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._running is not None:
            entry, task = self._running
            self._running = None
            task.cancel()
            logger.info(
                "the validation of checkpoint %d was cancelled; it stays pending", entry.index
            )

    def _loop(self) -> None:
        warned = None
        while not self._stop.is_set():
            draining = self._draining.is_set()  # before the step: it sees every commit
            try:
                idle = self._step()
            except Exception as err:  # noqa: BLE001 - any filesystem's error, tried again
                if draining:
                    logger.warning("validations left pending, the storage failed: %s", err)
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
        if self._running is not None:
            entry, task = self._running
            outcome = task.outcome()
            if outcome is None:
                return False
            self._running, self._outcome = None, (entry, outcome)
        if self._outcome is not None:
            entry, (status, metrics, error) = self._outcome
            record(self.storage, entry.index, status, metrics, error)  # raises: tried again
            self._outcome = None
            self._settled.add(entry.index)
            logger.info("checkpoint %d: %s %s", entry.index, status, error or metrics)
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
        self._running = (entry, kind(self._remote, self._fn, kwargs, checkpoint, timeout_s))
        logger.info("validating checkpoint %d", entry.index)
        return False


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
        except Exception as err:  # noqa: BLE001 - the function's failure, recorded
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
