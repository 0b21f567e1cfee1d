"""What the ranks are: how many, where they run, what each reserves, elastic bounds.

Frozen dataclasses that validate in ``__post_init__``, so a bad value raises
:class:`~horovod_ray.errors.ConfigError` naming the parameter before any Ray call;
:func:`job_layouts` turns RayExecutor's arguments into them.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Mapping, Sequence

from horovod_ray.errors import ConfigError
from horovod_ray.settings import is_int, require_positive, require_seconds

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """How many workers to start and how Ray should place them.

    Exactly one of ``num_workers`` (packed anywhere), ``num_hosts`` (each host gets
    ``num_workers_per_host``, strictly spread) or ``hosts`` (named nodes, each with its
    ranks) is set, unless the job runs inside a placement group that already exists,
    where all may be None and the group's bundles decide.
    """

    num_workers: int | None = None
    num_hosts: int | None = None
    # None is accepted where the count is unused, as horovod.ray accepts it.
    num_workers_per_host: int | None = 1
    cpus_per_worker: float = 1
    use_gpu: bool = False
    gpus_per_worker: float | None = None
    use_current_placement_group: bool = True
    # horovodrun's host list: (host, ranks) pairs, a host being a Ray node's address or
    # host name, or "localhost" for the driver's node; its ranks in that order.
    hosts: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.hosts is not None:
            object.__setattr__(
                self, "hosts", _check_hosts(self.hosts, self.num_workers, self.num_hosts)
            )
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
        """Raises ConfigError when no count is given (needed outside a placement group)."""
        if self.num_workers is None and self.num_hosts is None and self.hosts is None:
            raise ConfigError(
                "num_workers",
                "give num_workers (e.g. num_workers=2) or num_hosts with num_workers_per_host; "
                "only inside an existing placement group may both be omitted",
            )


def _check_hosts(
    hosts: object, num_workers: int | None, num_hosts: int | None
) -> tuple[tuple[str, int], ...]:
    """``hosts`` as (host, ranks) pairs; ConfigError naming what is wrong."""
    if num_workers is not None or num_hosts is not None:
        raise ConfigError("hosts", "give hosts alone: it sets the ranks and where they run")
    pairs = ()
    if isinstance(hosts, (list, tuple)) and all(isinstance(p, (list, tuple)) for p in hosts):
        pairs = tuple(tuple(pair) for pair in hosts)
    good = pairs and all(
        len(pair) == 2 and isinstance(pair[0], str) and pair[0] and is_int(pair[1]) and pair[1] >= 1
        for pair in pairs
    )
    if not good:
        raise ConfigError(
            "hosts", f"hosts must be (host, ranks) pairs such as [('10.0.0.1', 2)], got {hosts!r}"
        )
    names = [name for name, _ in pairs]
    if len(set(names)) < len(names):
        raise ConfigError("hosts", f"hosts names a host twice: {names}; give each once")
    return pairs


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
    # The user's horovod HostDiscovery, narrowing Ray's nodes (discovery.narrow); None:
    # every node with room.
    discovery: Any = None

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
            is_int(self.reset_limit) and self.reset_limit >= 0
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
                and all(is_int(b) for b in bounds)
                and 1 <= bounds[0] <= bounds[1] <= 3600
            ):
                raise ConfigError(
                    "cooldown_range",
                    f"cooldown_range must be (low, high) whole seconds with "
                    f"1 <= low <= high <= 3600, got {self.cooldown_range!r}",
                )
            object.__setattr__(self, "cooldown_range", bounds)
        require_seconds("elastic_timeout", self.elastic_timeout_s)
        require_seconds("discovery_interval_s", self.discovery_interval_s)


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
    hosts: Sequence[tuple[str, int]] | None,
    override_discovery: Any = True,
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
        "override_discovery": _user_discovery(override_discovery),
    }
    bounds = _elastic_bounds(num_workers, num_hosts, min_workers, max_workers, limits)
    if bounds is not None and hosts is not None:
        raise ConfigError("hosts", "an elastic job finds its hosts itself: leave hosts unset")
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
        hosts=hosts,
    )
    if not use_current_placement_group:
        layout.require_counts()
    return layout, bounds


# horovod.ray's older constructor names (horovod 0.20-0.22), and what each became.
OLD_NAMES = {
    "num_slots": "num_workers_per_host",
    "cpus_per_slot": "cpus_per_worker",
    "gpus_per_slot": "gpus_per_worker",
}
# What the new names are when not given, to tell a clash from a default.
_DEFAULTS = {"num_workers_per_host": 1, "cpus_per_worker": 1, "gpus_per_worker": None}


def with_old_names(arguments: dict[str, Any]) -> dict[str, Any]:
    """RayExecutor's arguments with horovod.ray's older names (``num_slots``,
    ``cpus_per_slot``, ``gpus_per_slot``) moved to today's, each with a
    DeprecationWarning, as horovod 0.22 did; ``num_slots`` alone also means one host,
    as in horovod 0.20 and ``run()``.

    Raises:
        ConfigError: An old name with its new one set to another value, or
            ``num_slots`` where it has no meaning.
    """
    arguments = dict(arguments)
    for old, new in OLD_NAMES.items():
        value = arguments.pop(old, None)
        if value is None:
            continue
        require_positive(old, value, integer=old == "num_slots")
        if arguments[new] not in (_DEFAULTS[new], value):
            raise ConfigError(
                old, f"{old}={value!r} and {new}={arguments[new]!r} clash: give {new} alone"
            )
        arguments[new] = value
        instead = f"{new}={value!r}"
        if old == "num_slots":
            for other in ("num_workers", "min_workers", "max_workers", "hosts"):
                if arguments[other] is not None:
                    raise ConfigError(
                        "num_slots",
                        f"num_slots (ranks per host) goes with num_hosts, not {other}: give "
                        f"num_hosts=H, num_workers_per_host={value!r}, or {other} alone",
                    )
            if arguments["num_hosts"] is None:
                arguments["num_hosts"] = 1
            instead = f"num_hosts={arguments['num_hosts']!r}, {instead}"
        warnings.warn(
            f"{old} is horovod.ray's older name for {new}: give {instead} instead",
            DeprecationWarning,
            stacklevel=3,  # the caller of RayExecutor()
        )
    return arguments


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
            if name == "elastic_timeout" and value is not None:
                # horovod.ray takes it (its default is 600) and ignores it on a static job.
                require_seconds(name, value)
                logger.warning(
                    "elastic_timeout=%r is ignored: this is a static job (it is for elastic "
                    "jobs, with min_workers)",
                    value,
                )
            elif value is not None:
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
        discovery=limits["override_discovery"],
    )


def _user_discovery(override_discovery: Any) -> Any:
    """upstream's ``override_discovery``: True (the default) lets Ray's node table decide,
    None here; a horovod ``HostDiscovery`` narrows it to the hosts it names."""
    if override_discovery is True:
        return None
    if callable(getattr(override_discovery, "find_available_hosts_and_slots", None)):
        return override_discovery
    if override_discovery is False:
        why = (
            "False (horovod.ray then reads settings.discovery, which these settings do not "
            "carry): pass the discovery itself, override_discovery=MyDiscovery()"
        )
    else:
        why = f"{type(override_discovery).__name__} {override_discovery!r}"
    raise ConfigError(
        "override_discovery",
        f"override_discovery must be True (Ray's nodes) or a horovod HostDiscovery whose "
        f"hosts are Ray nodes (address, host name or node id), got {why}",
    )
