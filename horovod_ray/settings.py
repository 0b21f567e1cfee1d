"""What the user asked for: job settings and the ranks' extra environment, validated.

``Settings`` is a frozen dataclass that validates in ``__post_init__``, so a bad value
raises :class:`~horovod_ray.errors.ConfigError` naming the parameter before any Ray call;
what the ranks are (how many, where, elastic bounds) is in ``layouts``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from typing import Iterable, Mapping

from horovod_ray.checkpoints import spec
from horovod_ray.checkpoints import validation as validations
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.checkpoints.validation import Validation
from horovod_ray.errors import ConfigError

logger = logging.getLogger(__name__)

_ssh_warned = False
# Default seconds before a job whose ranks wait on one that never joins their collective
# fails: Ray Train's worker health check gives up after 600 s too; horovod's stall
# inspector warns after 60 s and by default never stops (docs/failures.rst, "A stuck job").
STALL_TIMEOUT_S = 600.0
# horovod's stall inspector: how often it looks (and warns), when it shuts the job down.
STALL_WARNING_ENV = "HOROVOD_STALL_CHECK_TIME_SECONDS"
STALL_SHUTDOWN_ENV = "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"


# The longest duration any ``*_s`` setting takes: a year. Longer ones mean "never", and
# some are handed on as whole seconds (HOROVOD_GLOO_TIMEOUT_SECONDS) or to waits that
# overflow far below float's range.
MAX_SECONDS = 365 * 24 * 3600
# The most of a count (ranks, hosts, ranks per host) and of a resource one rank reserves:
# far above any cluster, and far below what a list of bundles or Ray's fixed-point
# resource amounts can hold (10**30 ranks would be allocated as a list of bundles).
MAX_COUNT = 1 << 20
MAX_AMOUNT = 1e6


def _is_number(value: object) -> bool:
    """A real number that is finite: inf and nan pass every comparison check otherwise
    (nan > 0 is False, so does nan <= 0) and fail only once Ray resources are taken."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_positive(name: str, value: object, *, integer: bool = False) -> None:
    """Raises ConfigError unless ``value`` is a positive number (an integer if asked) no
    larger than :data:`MAX_COUNT` (a count) or :data:`MAX_AMOUNT` (a resource amount)."""
    kind = "an integer" if integer else "a finite number"
    if not (is_int(value) if integer else _is_number(value)):
        raise ConfigError(name, f"{name} must be {kind} > 0, got {value!r}")
    if value <= 0:
        raise ConfigError(name, f"{name} must be > 0, got {value!r}")
    most = MAX_COUNT if integer else MAX_AMOUNT
    if value > most:
        raise ConfigError(name, f"{name} must be at most {most:g}, got {value!r}")


def require_seconds(name: str, value: object, *, zero: str | None = None) -> None:
    """Raises ConfigError unless ``value`` is a duration in seconds: finite, > 0 (or 0
    when ``zero`` says what 0 means) and at most :data:`MAX_SECONDS`."""
    lowest = ">= 0" if zero else "> 0"
    meaning = f" ({zero})" if zero else ""
    if not _is_number(value) or value < 0 or (value == 0 and not zero):
        raise ConfigError(
            name, f"{name} must be a finite number of seconds {lowest}{meaning}, got {value!r}"
        )
    if value > MAX_SECONDS:
        raise ConfigError(
            name,
            f"{name} must be at most {MAX_SECONDS} seconds (a year), got {value!r}"
            + ("; give 0 for none" if zero else ""),
        )


def _normalize_nics(nics: object) -> tuple[str, ...] | None:
    """Checks the shape of ``nics``; which node has which interface is checked at start."""
    if nics is None:
        return None
    if isinstance(nics, str):
        # A bare string would otherwise be read as a set of one-letter interfaces.
        return _normalize_nics([nics])
    if isinstance(nics, (set, frozenset)):
        if len(nics) > 1:
            raise ConfigError(
                "nics",
                f"nics is an order of preference (each node uses the first it has), so a set "
                f"of several is ambiguous: give a list such as {sorted(nics, key=str)!r}",
            )
        items = list(nics)
    elif isinstance(nics, (list, tuple)):
        items = list(nics)
    else:
        raise ConfigError(
            "nics",
            f"nics must be None or a list of interface names such as ['eth0', 'ens5'], "
            f"got {type(nics).__name__} {nics!r}",
        )
    if not items:
        raise ConfigError("nics", "nics must name at least one interface, or be None")
    for item in items:
        if not isinstance(item, str) or not item:
            raise ConfigError("nics", f"nics must hold interface names (str), got {item!r}")
    return tuple(dict.fromkeys(items))


@dataclasses.dataclass(frozen=True)
class Settings:
    """Job-wide settings; build them with ``RayExecutor.create_settings``.

    Attributes:
        timeout_s: Seconds Gloo waits for peers (rendezvous and collectives) before failing.
        placement_group_timeout_s: Seconds to wait for Ray to reserve the workers' resources.
        nics: Network interfaces Gloo may use, in order of preference: on each node the
            ranks use the first of them that node has (a node with none of them fails the
            start). None picks one per node: loopback when the whole job is on one node,
            else the interface holding the node's Ray address.
        verbose: 0 logs the rank table at DEBUG, 1 at INFO, 2 also logs rendezvous
            traffic; True and False (horovod.ray's) are 1 and 0.
        stall_timeout_s: Seconds ranks may wait in a collective that another rank never
            enters before the job fails with ``HangError`` (horovod's stall inspector,
            made to shut the job down); 0 turns it off.
        niceness: The ranks' niceness, from 0 (horovodrun's priority) to 19. None keeps
            the one Ray gives its workers (15 unless the node was started with
            ``RAY_worker_niceness=0``; 0 on the local Ray ``run()`` starts). Lowering it
            below Ray's needs CAP_SYS_NICE (root has it) or RLIMIT_NICE on the ranks'
            nodes; where a rank may not, a static job's start fails with ConfigError,
            releasing everything (an elastic job's slot fails, as for ``nics``).
        storage: Where rank 0's reported checkpoints persist and jobs resume from
            (``create_settings(storage_path=..., name=...)``); None keeps none.
        name: The job's name in its metrics and in ``horovod-ray status`` (with a
            storage path, also its folder there); None: the storage's folder name, else
            ``run()``'s function's name, else "job".
        metrics: Export the job's metrics through Ray's metrics pipeline and the ranks'
            through their nodes' (docs/observability.rst).
        report_values: With ``metrics``, each rank also exports the numbers it passes
            to ``report()``.
        find_stragglers: With ``metrics``, name the rank the others wait for: horovod's
            coordinator then sees every collective's requests, with its response cache
            off, which costs about 4 % of a step of 100 small gradients (BT4 in
            docs/benchmarks.rst); so off by default.
        timeline: A path on the driver: rank 0 records horovod's timeline (a Chrome
            trace, ``HOROVOD_TIMELINE``) wherever it runs, and the file is written here
            when the job stops (a static job's; None: no timeline).
        validation: The run's ``ValidationConfig``, checked
            (``create_settings(validation_config=...)``): ``report(validation=...)``'s
            checkpoints are validated by its function (``checkpoints.validation``).
            Needs ``storage``.
    """

    timeout_s: float = 120
    placement_group_timeout_s: float = 100
    nics: tuple[str, ...] | None = None
    verbose: int = 1
    stall_timeout_s: float = STALL_TIMEOUT_S
    niceness: int | None = None
    storage: RunStorage | None = None
    name: str | None = None
    metrics: bool = True
    report_values: bool = False
    find_stragglers: bool = False
    timeline: str | None = None
    validation: Validation | None = None

    def __post_init__(self) -> None:
        if self.timeline is not None:
            if isinstance(self.timeline, os.PathLike):
                object.__setattr__(self, "timeline", os.fspath(self.timeline))
            if not isinstance(self.timeline, str) or not self.timeline:
                raise ConfigError(
                    "timeline", f"timeline must be a file path or None, got {self.timeline!r}"
                )
            # The driver's folder now: the file is written when the job stops.
            object.__setattr__(self, "timeline", os.path.abspath(self.timeline))
        for flag in ("metrics", "report_values", "find_stragglers"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(
                    flag, f"{flag} must be True or False, got {getattr(self, flag)!r}"
                )
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ConfigError("name", f"name must be a non-empty str or None, got {self.name!r}")
        if self.name is None and self.storage is not None:
            object.__setattr__(self, "name", self.storage.name)
        require_seconds("timeout_s", self.timeout_s)
        require_seconds("stall_timeout_s", self.stall_timeout_s, zero="0: no hang detection")
        require_seconds("placement_group_timeout_s", self.placement_group_timeout_s)
        object.__setattr__(self, "nics", _normalize_nics(self.nics))
        if isinstance(self.verbose, bool):  # horovod.ray's settings take True and False
            object.__setattr__(self, "verbose", int(self.verbose))
        if not is_int(self.verbose) or self.verbose < 0:
            raise ConfigError("verbose", f"verbose must be an integer >= 0, got {self.verbose!r}")
        if self.niceness is not None and not (is_int(self.niceness) and 0 <= self.niceness <= 19):
            raise ConfigError(
                "niceness",
                f"niceness must be None (Ray's) or an integer from 0 (horovodrun's priority) "
                f"to 19, got {self.niceness!r}; a negative one would put the ranks ahead of "
                f"Ray's own processes on their nodes",
            )
        if self.storage is not None and not isinstance(self.storage, RunStorage):
            raise ConfigError(
                "storage", "storage must come from create_settings(storage_path=..., name=...)"
            )
        if self.validation is not None and not isinstance(self.validation, Validation):
            raise ConfigError(
                "validation", "validation must come from create_settings(validation_config=...)"
            )
        if self.validation is not None and self.storage is None:
            raise ConfigError(
                "validation_config",
                "validation_config is given but storage_path is not: a validation reads a "
                "checkpoint the run persisted; give storage_path",
            )


def create_settings(
    timeout_s: float = 120,
    ssh_identity_file: str | None = None,
    ssh_str: str | None = None,
    placement_group_timeout_s: float = 100,
    nics: Iterable[str] | None = None,
    *,
    verbose: int = 1,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    niceness: int | None = None,
    storage_path: str | None = None,
    name: str | None = None,
    checkpoint_config: object = None,
    storage_filesystem: object = None,
    metrics: bool = True,
    report_values: bool = False,
    find_stragglers: bool = False,
    timeline: str | None = None,
    validation_config: object = None,
) -> Settings:
    """Builds validated job settings (see :class:`Settings`).

    The first five parameters are ``horovod.ray``'s, in its order, so that code written
    for it runs unchanged; the others are keyword-only. ``ssh_identity_file`` and
    ``ssh_str`` are accepted for that reason alone: Ray starts the workers, so they are not
    used and no key material is written anywhere.

    ``storage_path``, ``name``, ``checkpoint_config`` and ``storage_filesystem`` are Ray
    Train's (its ``RunConfig``): with a storage path, what rank 0 reports with
    ``horovod_ray.report(metrics, checkpoint=...)`` persists to ``storage_path/name``
    (``name`` None: one made from the time), and a job started with the same two
    resumes from the latest checkpoint there (``horovod_ray.get_checkpoint()``); see
    ``horovod_ray.checkpoints.spec.create``. ``name`` also names the job in its metrics
    and in ``horovod-ray status``; ``metrics``, ``report_values``, ``find_stragglers`` and
    ``timeline`` are :class:`Settings`'. ``validation_config`` (a
    ``ray.train.ValidationConfig``) is Ray Train's trainer's: it validates the
    checkpoints reported with ``validation=True`` (needs ``storage_path``).

    Raises:
        ConfigError: A value is out of range or of the wrong type.
    """
    for parameter, value in (("ssh_identity_file", ssh_identity_file), ("ssh_str", ssh_str)):
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                parameter,
                f"{parameter} must be a str or None, got {value!r}; the positional order is "
                f"horovod.ray's (timeout_s, ssh_identity_file, ssh_str, "
                f"placement_group_timeout_s, nics): pass the others by name",
            )
    global _ssh_warned
    if (ssh_identity_file is not None or ssh_str is not None) and not _ssh_warned:
        _ssh_warned = True
        logger.warning(
            "ssh_identity_file / ssh_str are ignored: Ray starts the workers, no SSH is used"
        )
    return Settings(
        timeout_s=timeout_s,
        placement_group_timeout_s=placement_group_timeout_s,
        nics=nics,
        verbose=verbose,
        stall_timeout_s=stall_timeout_s,
        niceness=niceness,
        storage=spec.create(storage_path, name, checkpoint_config, storage_filesystem),
        name=name,
        metrics=metrics,
        report_values=report_values,
        find_stragglers=find_stragglers,
        timeline=timeline,
        validation=validations.check_config(validation_config),
    )


# Environment variables the executor sets itself; extra_env_vars may not override them.
MANAGED_ENV = frozenset(
    {
        "HOROVOD_RANK",
        "HOROVOD_SIZE",
        "HOROVOD_LOCAL_RANK",
        "HOROVOD_LOCAL_SIZE",
        "HOROVOD_CROSS_RANK",
        "HOROVOD_CROSS_SIZE",
        "HOROVOD_HOSTNAME",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR",
        "HOROVOD_GLOO_RENDEZVOUS_PORT",
        "HOROVOD_GLOO_RENDEZVOUS_BATCH",
        "HOROVOD_CONTROLLER",
        "HOROVOD_CPU_OPERATIONS",
        "HOROVOD_GLOO_IFACE",
        "HOROVOD_GLOO_TIMEOUT_SECONDS",
        "HOROVOD_ELASTIC",
        spec.STORAGE_ENV,
        spec.CHECKPOINT_ENV,
        spec.FIRST_INDEX_ENV,
        validations.VALIDATION_ENV,
        "HOROVOD_RAY_JOB_ID",
        "HOROVOD_RAY_JOB_NAME",
        "HOROVOD_RAY_METRICS",
        "HOROVOD_RAY_TIMELINE",
        "HOROVOD_RAY_PREEMPTION_DIR",
    }
)


def check_env(
    env: Mapping[str, object] | None, parameter: str = "extra_env_vars"
) -> dict[str, str]:
    """Checks the ranks' extra environment (``parameter``, the caller's name for it);
    numbers and booleans become ``str(value)``, as upstream."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError(
            parameter,
            f"{parameter} must be a dict of variable names to values, got {env!r}",
        )
    checked = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError(
                parameter,
                f"{parameter} keys must be variable names, got {key!r}",
            )
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(
                parameter,
                f"{parameter} values must be str, int, float or bool, got {key!r}: "
                f"{value!r} ({type(value).__name__})",
            )
        if key in MANAGED_ENV:
            raise ConfigError(
                parameter,
                f"{parameter} may not set {key}: the executor sets it (use "
                f"create_settings for timeouts and interfaces)",
            )
        checked[key] = str(value)
    return checked


def require_settings(settings: object) -> Settings:
    """``settings`` as RayExecutor takes it: None means the defaults."""
    if settings is None:
        return create_settings()
    if not isinstance(settings, Settings):
        raise ConfigError(
            "settings",
            f"settings must come from RayExecutor.create_settings(...), "
            f"got {type(settings).__name__}",
        )
    return settings
