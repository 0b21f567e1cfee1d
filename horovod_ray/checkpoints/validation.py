"""``report(validation=...)``: Ray Train's checkpoint validation (Ray 2.60, alpha) in a
run with a storage path.

The run's ``ray.train.ValidationConfig(fn=...)`` stays on the driver. A rank 0 report
that asks for a validation has its request (``fn_kwargs``, ``timeout_s``) written into
the checkpoint's marker, as pending, when the checkpoint is committed. The driver's
:class:`Validator` finds such markers and runs ``fn(checkpoint, **fn_kwargs)`` as a Ray
task, one at a time and oldest first (as Ray Train does). It writes the outcome into the
marker (``validator``):

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
from typing import Any, Callable

from horovod_ray.checkpoints.choices import PENDING_VALIDATION, marker_name
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
# How often a validation that has not ended, or a rank waiting for one, says so (as
# Ray Train's wait warns every minute).
WARN_S = 60.0


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
    task_config = config.task_config
    if task_config is not None and not (
        hasattr(task_config, "fn_kwargs") and hasattr(task_config, "timeout_s")
    ):
        raise ConfigError(
            "validation_config",
            f"validation_config.task_config must be a ray.train.ValidationTaskConfig or "
            f"None, got {task_config!r}",
        )
    fn_kwargs, timeout_s = _task_fields(task_config, "validation_config.task_config")
    remote_kwargs = config.ray_remote_kwargs or {}
    if not isinstance(remote_kwargs, dict) or remote_kwargs.get("num_returns", 1) != 1:
        raise ConfigError(
            "validation_config",
            f"validation_config.ray_remote_kwargs must be a dict of ray.remote's options for "
            f"a task returning one dict, got {remote_kwargs!r}",
        )
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
        remote(remote_kwargs)  # Ray checks the options' names and values
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
    if "checkpoint" in fn_kwargs:
        raise ConfigError(
            parameter,
            f"{name}.fn_kwargs may not hold 'checkpoint': the function is given the "
            f"checkpoint first, as its own argument",
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
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, (int, float))
        or not 0 < timeout_s < float("inf")
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
    storage: RunStorage,
    index: int,
    status: str,
    metrics: dict,
    error: str | None,
    *,
    written: Any,
) -> bool:
    """Writes a validation's outcome into checkpoint ``index``'s marker: ``status``, the
    ``error`` of one that failed, and ``metrics`` merged into the checkpoint's (over
    those of the same name). Only while the marker is the one validated (its ``time``
    is ``written``, ``Entry.time``) and still pending: a pending checkpoint is never
    removed, so its folder is there. Whether it was written.

    Raises:
        CheckpointError: The storage could not be read or written.
    """
    name = marker_name(index)
    marker = read_json(storage, name)
    if (
        not isinstance(marker, dict)
        or not isinstance(marker.get("metrics"), dict)
        or (marker.get("validation") or {}).get("status") != PENDING_VALIDATION
        or marker.get("time") != written
    ):
        return False  # removed, recorded already, or another checkpoint now
    outcome = dict(marker.get("validation") or {}, status=status)
    if error is not None:
        outcome["error"] = error
    marker = {**marker, "metrics": {**marker["metrics"], **metrics}, "validation": outcome}
    try:
        write_json(storage, name, encoded(marker))
    except storage_errors() as err:
        raise failed("write", f"{storage.run_path}/{name}", err) from err
    return True


def remote(remote_kwargs: dict) -> Any:
    """``validate`` as a Ray remote function with ``remote_kwargs`` (Ray checks them)."""
    import ray

    task = ray.remote(validate)
    return task.options(**remote_kwargs) if remote_kwargs else task
