"""What the user asked for: job settings and worker layout, validated when built.

Both classes are frozen dataclasses that validate in ``__post_init__``, so a bad value
raises :class:`~horovod_ray.errors.ConfigError` naming the parameter before any Ray call.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Iterable, Mapping

from horovod_ray.errors import ConfigError

logger = logging.getLogger(__name__)

_ssh_warned = False


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_positive(name: str, value: object, *, integer: bool = False) -> None:
    """Raises ConfigError unless ``value`` is a positive number (an integer if asked)."""
    kind = "an integer" if integer else "a number"
    if not (_is_int(value) if integer else _is_number(value)):
        raise ConfigError(name, f"{name} must be {kind} > 0, got {value!r}")
    if value <= 0:
        raise ConfigError(name, f"{name} must be > 0, got {value!r}")


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
        verbose: 0 logs the rank table at DEBUG, 1 at INFO, 2 also logs rendezvous traffic.
    """

    timeout_s: float = 120
    placement_group_timeout_s: float = 100
    nics: tuple[str, ...] | None = None
    verbose: int = 1

    def __post_init__(self) -> None:
        require_positive("timeout_s", self.timeout_s)
        require_positive("placement_group_timeout_s", self.placement_group_timeout_s)
        object.__setattr__(self, "nics", _normalize_nics(self.nics))
        if not _is_int(self.verbose) or self.verbose < 0:
            raise ConfigError("verbose", f"verbose must be an integer >= 0, got {self.verbose!r}")


def create_settings(
    timeout_s: float = 120,
    placement_group_timeout_s: float = 100,
    nics: Iterable[str] | None = None,
    verbose: int = 1,
    ssh_identity_file: str | None = None,
    ssh_str: str | None = None,
) -> Settings:
    """Builds validated job settings (see :class:`Settings`).

    ``ssh_identity_file`` and ``ssh_str`` are accepted so that code written for
    ``horovod.ray`` runs unchanged; Ray starts the workers, so they are not used and no key
    material is written anywhere.

    Raises:
        ConfigError: A value is out of range or of the wrong type.
    """
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
    )


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """How many workers to start and how Ray should place them.

    Exactly one of ``num_workers`` (packed anywhere) or ``num_hosts`` (each host gets
    ``num_workers_per_host``, strictly spread) is set, unless the job runs inside a placement
    group that already exists, where both may be None and the group's bundles decide.
    """

    num_workers: int | None = None
    num_hosts: int | None = None
    # None is accepted where the count is unused, as horovod.ray accepts it.
    num_workers_per_host: int | None = 1
    cpus_per_worker: float = 1
    use_gpu: bool = False
    gpus_per_worker: float | None = None
    use_current_placement_group: bool = True

    def __post_init__(self) -> None:
        if self.num_workers is not None:
            require_positive("num_workers", self.num_workers, integer=True)
        if self.num_hosts is not None:
            require_positive("num_hosts", self.num_hosts, integer=True)
        if self.num_workers is not None and self.num_hosts is not None:
            raise ConfigError(
                "num_workers",
                "give either num_workers (workers packed anywhere) or num_hosts with "
                "num_workers_per_host (workers spread over hosts), not both",
            )
        if self.num_workers_per_host is None:
            if self.num_hosts is not None:
                raise ConfigError(
                    "num_workers_per_host",
                    "num_hosts needs num_workers_per_host (ranks on each host), got None",
                )
            object.__setattr__(self, "num_workers_per_host", 1)
        require_positive("num_workers_per_host", self.num_workers_per_host, integer=True)
        require_positive("cpus_per_worker", self.cpus_per_worker)
        if not isinstance(self.use_gpu, bool):
            raise ConfigError("use_gpu", f"use_gpu must be True or False, got {self.use_gpu!r}")
        if self.gpus_per_worker is not None:
            if not self.use_gpu:
                raise ConfigError(
                    "gpus_per_worker", "gpus_per_worker needs use_gpu=True; set both or neither"
                )
            require_positive("gpus_per_worker", self.gpus_per_worker)
        if not isinstance(self.use_current_placement_group, bool):
            raise ConfigError(
                "use_current_placement_group",
                f"use_current_placement_group must be True or False, "
                f"got {self.use_current_placement_group!r}",
            )

    @property
    def gpus(self) -> float:
        """GPUs each worker reserves (0 without ``use_gpu``)."""
        if not self.use_gpu:
            return 0
        return 1 if self.gpus_per_worker is None else self.gpus_per_worker

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources one worker reserves."""
        resources = {"CPU": float(self.cpus_per_worker)}
        if self.gpus:
            resources["GPU"] = float(self.gpus)
        return resources

    def require_counts(self) -> None:
        """Raises ConfigError when neither count is given (needed outside a placement group)."""
        if self.num_workers is None and self.num_hosts is None:
            raise ConfigError(
                "num_workers",
                "give num_workers (e.g. num_workers=2) or num_hosts with num_workers_per_host; "
                "only inside an existing placement group may both be omitted",
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
    }
)


def check_env(env: Mapping[str, object] | None) -> dict[str, str]:
    """Checks ``extra_env_vars``; numbers and booleans become ``str(value)``, as upstream."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise ConfigError(
            "extra_env_vars",
            f"extra_env_vars must be a dict of variable names to values, got {env!r}",
        )
    checked = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError(
                "extra_env_vars",
                f"extra_env_vars keys must be variable names, got {key!r}",
            )
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(
                "extra_env_vars",
                f"extra_env_vars values must be str, int, float or bool, got {key!r}: "
                f"{value!r} ({type(value).__name__})",
            )
        if key in MANAGED_ENV:
            raise ConfigError(
                "extra_env_vars",
                f"extra_env_vars may not set {key}: the executor sets it (use "
                f"create_settings for timeouts and interfaces)",
            )
        checked[key] = str(value)
    return checked


@dataclasses.dataclass(frozen=True)
class ElasticLayout:
    """An elastic job's bounds and limits (see ``RayExecutor(min_workers=...)``).

    The world grows to ``max_workers`` ranks while the cluster has room and shrinks to no
    fewer than ``min_workers``. What one rank reserves is the executor's
    :class:`WorkerLayout` (``cpus_per_worker``, GPUs), checked there.
    """

    min_workers: int
    max_workers: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[int, int] | None = None
    elastic_timeout_s: float = 600
    discovery_interval_s: float = 1.0

    def __post_init__(self) -> None:
        require_positive("min_workers", self.min_workers, integer=True)
        if self.max_workers is not None:
            require_positive("max_workers", self.max_workers, integer=True)
            if self.max_workers < self.min_workers:
                raise ConfigError(
                    "max_workers",
                    f"max_workers={self.max_workers} is below min_workers="
                    f"{self.min_workers}; give max_workers >= min_workers (or None)",
                )
        if self.reset_limit is not None and not (
            _is_int(self.reset_limit) and self.reset_limit >= 0
        ):
            raise ConfigError(
                "reset_limit",
                f"reset_limit must be an integer >= 0 (or None: no limit), "
                f"got {self.reset_limit!r}",
            )
        if self.cooldown_range is not None:
            bounds = (
                tuple(self.cooldown_range) if isinstance(self.cooldown_range, (tuple, list)) else ()
            )
            if not (
                len(bounds) == 2
                and all(_is_int(b) for b in bounds)
                and 1 <= bounds[0] <= bounds[1] <= 3600
            ):
                raise ConfigError(
                    "cooldown_range",
                    f"cooldown_range must be (low, high) whole seconds with "
                    f"1 <= low <= high <= 3600, got {self.cooldown_range!r}",
                )
            object.__setattr__(self, "cooldown_range", bounds)
        require_positive("elastic_timeout", self.elastic_timeout_s)
        require_positive("discovery_interval_s", self.discovery_interval_s)


def job_layouts(
    *,
    num_workers: int | None,
    num_hosts: int | None,
    num_workers_per_host: int | None,
    cpus_per_worker: float,
    use_gpu: bool,
    gpus_per_worker: float | None,
    use_current_placement_group: bool,
    min_workers: int | None,
    max_workers: int | None,
    reset_limit: int | None,
    cooldown_range: tuple[int, int] | None,
    elastic_timeout: float | None,
    discovery_interval_s: float | None,
) -> tuple[WorkerLayout, ElasticLayout | None]:
    """RayExecutor's arguments as layouts: what each rank reserves, and the elastic
    bounds when ``min_workers`` or ``max_workers`` is given (else None: a static job).

    Raises:
        ConfigError: Naming the argument that does not fit.
    """
    limits = {
        "reset_limit": reset_limit,
        "cooldown_range": cooldown_range,
        "elastic_timeout": elastic_timeout,
        "discovery_interval_s": discovery_interval_s,
    }
    bounds = _elastic_bounds(num_workers, num_hosts, min_workers, max_workers, limits)
    if bounds is not None:
        num_workers = min_workers
    layout = WorkerLayout(
        num_workers=num_workers,
        num_hosts=num_hosts,
        num_workers_per_host=num_workers_per_host,
        cpus_per_worker=cpus_per_worker,
        use_gpu=use_gpu,
        gpus_per_worker=gpus_per_worker,
        use_current_placement_group=use_current_placement_group,
    )
    if not use_current_placement_group:
        layout.require_counts()
    return layout, bounds


def _elastic_bounds(
    num_workers: int | None,
    num_hosts: int | None,
    min_workers: int | None,
    max_workers: int | None,
    limits: Mapping[str, object],
) -> ElasticLayout | None:
    """The elastic bounds, None for a static job (which then may not set the limits)."""
    if min_workers is None and max_workers is None:
        for name, value in limits.items():
            if value is not None:
                raise ConfigError(
                    name, f"{name} is for elastic jobs: give min_workers too, or drop it"
                )
        return None
    if num_workers is not None or num_hosts is not None:
        raise ConfigError(
            "min_workers",
            "an elastic job (min_workers/max_workers) sizes itself: leave num_workers "
            "and num_hosts unset",
        )
    if min_workers is None:
        raise ConfigError(
            "min_workers", "max_workers needs min_workers (the fewest ranks to run on)"
        )
    timeout, interval = limits["elastic_timeout"], limits["discovery_interval_s"]
    return ElasticLayout(
        min_workers=min_workers,
        max_workers=max_workers,
        reset_limit=limits["reset_limit"],
        cooldown_range=limits["cooldown_range"],
        elastic_timeout_s=600 if timeout is None else timeout,
        discovery_interval_s=1.0 if interval is None else interval,
    )
