"""horovod.ray's ``ElasticRayExecutor``, ``RayHostDiscovery`` and ``TestDiscovery``, on this
package's elastic job, so that code written for horovod.ray 0.2x runs with only its import
changed (the discoveries are defined in ``discovery/``).

``ElasticRayExecutor`` is a thin front for ``RayExecutor(min_workers=..., max_workers=...)``
(what new code uses, as horovod.ray itself advises since 0.25): its settings, its
``start()`` and ``run(worker_fn, callbacks=)``, and its discovery hook
(``override_discovery=False`` uses ``settings.discovery``, a horovod ``HostDiscovery``
such as a ``RayHostDiscovery`` subclass) map onto that executor's arguments.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

from horovod.runner.elastic.settings import ElasticSettings

from horovod_ray.discovery.chaos import HostChange, TestDiscovery
from horovod_ray.discovery.ray_nodes import RayHostDiscovery, hosts_and_slots
from horovod_ray.errors import ConfigError, named_as
from horovod_ray.settings import Settings, check_env, create_settings, require_positive

__all__ = [
    "ElasticRayExecutor",
    "ElasticRaySettings",
    "HostChange",
    "RayHostDiscovery",
    "TestDiscovery",
    "create_elastic_settings",
    "hosts_and_slots",
]

logger = logging.getLogger(__name__)

# horovod's settings for its own launcher (horovodrun), which its ElasticSettings also
# takes: Ray starts the ranks here, so each is taken and ignored, with a warning.
_LAUNCHER_SETTINGS = frozenset(
    {
        "ssh_port",
        "extra_mpi_args",
        "tcp_flag",
        "binding_args",
        "key",
        "start_timeout",
        "output_filename",
        "run_func_mode",
        "prefix_output_with_timestamp",
        "num_proc",
        "elastic",
    }
)
# This package's own keyword-only settings, taken here too.
_JOB_SETTINGS = (
    "placement_group_timeout_s",
    "stall_timeout_s",
    "niceness",
    "name",
    "metrics",
    "report_values",
    "find_stragglers",
)
# RayExecutor's names for what ElasticRayExecutor's user gives under these.
_NAMES = {
    "cpus_per_worker": "cpus_per_slot",
    "gpus_per_worker": "gpus_per_slot",
    "min_workers": "min_num_proc",
    "max_workers": "max_num_proc",
    "extra_env_vars": "env_vars",
    "fn": "worker_fn",
}


@dataclasses.dataclass
class ElasticRaySettings:
    """What ``ElasticRayExecutor.create_settings`` returns (horovod's ``ElasticSettings``
    there): the job's settings and the elastic bounds. ``discovery`` may be set by the
    user, for ``ElasticRayExecutor(..., override_discovery=False)``.

    Attributes:
        job: Timeouts, interfaces and verbosity, as ``RayExecutor.create_settings``.
        min_num_proc: The fewest ranks to train on.
        max_num_proc: The most ranks (None: as many as the cluster holds).
        reset_limit: Resets after which the job fails (None: no limit).
        elastic_timeout: Seconds the job may stay below ``min_num_proc``.
        cooldown_range: (low, high) seconds a failed host is kept out (None: for good).
        discovery: A horovod ``HostDiscovery`` naming the hosts to use (Ray nodes, by
            address, host name or node id), read at ``start()`` with
            ``override_discovery=False``.
    """

    job: Settings
    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    cooldown_range: tuple[int, int] | None = None
    discovery: Any = None

    @property
    def verbose(self) -> int:
        return self.job.verbose

    @property
    def timeout_s(self) -> float:
        return self.job.timeout_s


def create_elastic_settings(
    min_num_proc: int = 1,
    max_num_proc: int | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float = 600,
    timeout_s: float = 120,
    ssh_identity_file: str | None = None,
    nics: Iterable[str] | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    **kwargs: Any,
) -> ElasticRaySettings:
    """horovod.ray's ``ElasticRayExecutor.create_settings``, in its order.

    ``min_np`` and ``max_np`` are its older names for ``min_num_proc`` and
    ``max_num_proc`` (a DeprecationWarning, as there). ``timeout_s`` is Gloo's timeout,
    as in ``RayExecutor.create_settings`` (horovod.ray's 30 s was its launcher's start
    timeout). Of horovod's other settings, ``verbose`` (an int, or True/False; 0 by
    default, as horovod's) and ``cooldown_range`` are taken, as are this package's
    ``placement_group_timeout_s``, ``stall_timeout_s``, ``niceness``, ``name``,
    ``metrics``, ``report_values`` and ``find_stragglers``;
    ``ssh_identity_file`` and the settings of horovodrun's launcher (``ssh_port``,
    ``output_filename``, ...) are taken and not used, with a warning.

    Raises:
        ConfigError: A bad value, naming its parameter.
    """
    names = {"min_num_proc": "min_num_proc", "max_num_proc": "max_num_proc"}
    for old, new, value in (("min_np", "min_num_proc", min_np), ("max_np", "max_num_proc", max_np)):
        if value is not None:
            warnings.warn(f"{old} is deprecated, use {new}", DeprecationWarning, stacklevel=2)
            names[new] = old
    min_num_proc = min_num_proc if min_np is None else min_np
    max_num_proc = max_num_proc if max_np is None else max_np
    require_positive(names["min_num_proc"], min_num_proc, integer=True)
    if max_num_proc is not None:
        require_positive(names["max_num_proc"], max_num_proc, integer=True)
        if max_num_proc < min_num_proc:
            raise ConfigError(
                names["max_num_proc"],
                f"{names['max_num_proc']}={max_num_proc} is below "
                f"{names['min_num_proc']}={min_num_proc}",
            )
    ignored = sorted(name for name in kwargs if name in _LAUNCHER_SETTINGS)
    for name in kwargs:
        if name not in _LAUNCHER_SETTINGS and name not in (
            "verbose",
            "cooldown_range",
            *_JOB_SETTINGS,
        ):
            raise ConfigError(name, f"create_settings() takes no setting {name!r}")
    if ignored:
        logger.warning(
            "%s ignored: settings of horovodrun's launcher, which Ray replaces here",
            ", ".join(ignored),
        )
    job = create_settings(
        timeout_s,
        ssh_identity_file,
        nics=nics,
        verbose=kwargs.get("verbose", 0),
        **{name: kwargs[name] for name in _JOB_SETTINGS if name in kwargs},
    )
    return ElasticRaySettings(
        job=job,
        min_num_proc=min_num_proc,
        max_num_proc=max_num_proc,
        reset_limit=reset_limit,
        elastic_timeout=elastic_timeout,
        cooldown_range=kwargs.get("cooldown_range"),
    )


def _from_horovods(settings: ElasticSettings) -> ElasticRaySettings:
    """horovod's own ``ElasticSettings`` (which horovod.ray took too) as this package's:
    the bounds, limits, verbosity, interfaces and discovery it holds."""
    ours = create_elastic_settings(
        min_num_proc=settings.min_num_proc,
        max_num_proc=settings.max_num_proc,
        reset_limit=settings.reset_limit,
        elastic_timeout=settings.elastic_timeout,
        nics=settings.nics,
        verbose=settings.verbose,
        cooldown_range=settings.cooldown_range,
    )
    ours.discovery = settings.discovery
    return ours


class ElasticRayExecutor:
    """horovod.ray's elastic executor, deprecated there since 0.25: a front for
    ``RayExecutor(settings, min_workers=..., max_workers=...)``, which new code uses.

    ::

        settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4)
        executor = ElasticRayExecutor(settings, cpus_per_slot=1)
        executor.start()
        results = executor.run(train)  # train() uses hvd.elastic.run; one result per rank

    Args:
        settings: From :meth:`create_settings`, or horovod's own ``ElasticSettings``.
        use_gpu: Reserve GPUs for the ranks.
        cpus_per_slot: CPUs each rank reserves.
        gpus_per_slot: GPUs each rank reserves with ``use_gpu`` (default 1).
        env_vars: More environment variables for every rank.
        override_discovery: True (the default) uses every Ray node with room (and sets
            ``settings.discovery`` to a :class:`RayHostDiscovery`, as horovod.ray); False
            uses ``settings.discovery`` as it is at ``start()``, a horovod
            ``HostDiscovery`` (a ``RayHostDiscovery`` subclass, say), which only narrows
            Ray's nodes: a host it names must be a Ray node.

    Raises:
        ConfigError: A bad argument, before anything is started.
    """

    create_settings = staticmethod(create_elastic_settings)

    def __init__(
        self,
        settings: ElasticRaySettings | ElasticSettings,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: Mapping[str, object] | None = None,
        override_discovery: bool = True,
    ) -> None:
        warnings.warn(
            "ElasticRayExecutor is deprecated (as in horovod.ray): use "
            "RayExecutor(RayExecutor.create_settings(...), min_workers=..., max_workers=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        if isinstance(settings, ElasticSettings):
            settings = _from_horovods(settings)
        if not isinstance(settings, ElasticRaySettings):
            raise ConfigError(
                "settings",
                f"settings must come from ElasticRayExecutor.create_settings(...), got "
                f"{type(settings).__name__}",
            )
        if gpus_per_slot is not None and not use_gpu:
            raise ConfigError(
                "gpus_per_slot", "gpus_per_slot needs use_gpu=True; set both or neither"
            )
        if override_discovery not in (True, False):
            raise ConfigError(
                "override_discovery",
                f"override_discovery must be True (Ray's nodes) or False (settings.discovery), "
                f"got {override_discovery!r}",
            )
        self.settings = settings
        self.use_gpu, self.cpus_per_slot, self.gpus_per_slot = use_gpu, cpus_per_slot, gpus_per_slot
        self.override_discovery = override_discovery
        with named_as(_NAMES):
            self.env_vars = check_env(env_vars, "env_vars")
        if override_discovery:
            settings.discovery = RayHostDiscovery(use_gpu, cpus_per_slot, gpus_per_slot or 1)
        self._executor = self._job(True)  # checks the arguments now; rebuilt at start()

    def _job(self, discovery: Any) -> Any:
        from horovod_ray.executor import RayExecutor

        settings = self.settings
        with named_as(_NAMES):
            return RayExecutor(
                settings.job,
                min_workers=settings.min_num_proc,
                max_workers=settings.max_num_proc,
                reset_limit=settings.reset_limit,
                elastic_timeout=settings.elastic_timeout,
                cooldown_range=settings.cooldown_range,
                cpus_per_worker=self.cpus_per_slot,
                use_gpu=self.use_gpu,
                gpus_per_worker=self.gpus_per_slot,
                override_discovery=discovery,
            )

    def start(self) -> None:
        """Readies the job (each ``run()`` then places its own ranks), with the settings
        as they are now (``settings.discovery`` included).

        Raises:
            ConfigError: ``override_discovery=False`` and no ``settings.discovery``.
            HorovodRayError: Ray is not initialised, or the driver is a Ray Client.
        """
        if not self.override_discovery:
            if self.settings.discovery is None:
                raise ConfigError(
                    "override_discovery",
                    "override_discovery=False uses settings.discovery, which is None: set "
                    "settings.discovery = MyDiscovery() (a RayHostDiscovery subclass) first, "
                    "or leave override_discovery=True for every Ray node with room",
                )
            self._executor = self._job(self.settings.discovery)
        self._executor.start(extra_env_vars=self.env_vars)

    def run(
        self,
        worker_fn: Callable[[], Any],
        callbacks: Sequence[Callable[[dict], None]] | None = None,
    ) -> list[Any]:
        """Runs ``worker_fn()`` elastically on every rank until the last world ends.

        Args:
            worker_fn: The training function, without arguments, with ``hvd.elastic.run``
                inside.
            callbacks: Called on the driver with each dict a rank passes to
                ``ray_logger.log()`` (every rank's, as horovod.ray's), or rank 0 to
                ``horovod_ray.log()``; one with an ``on_membership`` method also gets each
                change of membership.

        Returns:
            The final world's return values, in rank order.

        Raises:
            ElasticLimitError: Below ``min_num_proc`` for ``elastic_timeout``, or more
                than ``reset_limit`` resets (a RuntimeError, as horovod.ray's).
            WorkerFailedError: The job failed otherwise (a RuntimeError too).
        """
        with named_as(_NAMES):
            return self._executor.run(worker_fn, callbacks=callbacks)

    def stop(self) -> None:
        """Ends a run in progress (from another thread); the job holds nothing otherwise."""
        self._executor.stop()

    shutdown = stop

    def __enter__(self) -> ElasticRayExecutor:
        from horovod_ray.job.lifecycle import ExecutorState

        if self._executor.state is ExecutorState.CREATED:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
