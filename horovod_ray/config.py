"""Ray Train's config objects in horovod_ray's words: the one place that reads a
``ScalingConfig``, a ``RunConfig`` (with its ``FailureConfig`` and ``CheckpointConfig``)
and a ``HorovodConfig``, so that ``run()``, ``RayExecutor`` and ``HorovodTrainer`` build
the same layouts, settings and restart budget from them as from their own keywords.

A field horovod_ray cannot honour is a ``ConfigError`` naming it (``scaling_config.X``),
raised before anything is taken; so is a config object given beside the keywords it
stands for: one of the two forms, not both, says what the job is.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Collection, Mapping

from horovod_ray.errors import ConfigError, named_as
from horovod_ray.settings import Settings, create_settings, require_positive, require_seconds

# The sizing keywords a ScalingConfig stands for: RayExecutor's, horovod.ray's older
# names and run()'s (the same ones).
SIZING = frozenset(
    {
        "num_workers",
        "num_hosts",
        "num_workers_per_host",
        "num_slots",
        "cpus_per_worker",
        "cpus_per_slot",
        "use_gpu",
        "gpus_per_worker",
        "gpus_per_slot",
        "min_workers",
        "max_workers",
        "hosts",
    }
)

# ScalingConfig.placement_strategy -> how the ranks of ScalingConfig(num_workers=N) are
# laid out: packed anywhere, N hosts of one, or one host of N. Ray's SPREAD (spread where
# it can) has no layout here.
_PLACEMENTS = {
    "PACK": lambda n: {"num_workers": n},
    "STRICT_SPREAD": lambda n: {"num_hosts": n, "num_workers_per_host": 1},
    "STRICT_PACK": lambda n: {"num_hosts": 1, "num_workers_per_host": n},
}
# ScalingConfig fields with no meaning here, and the value that leaves them unused.
_UNUSED_SCALING = {
    "accelerator_type": None,
    "label_selector": None,
    "use_tpu": False,
    "topology": None,
}
# The name Ray Train v2's RunConfig gives a run it was not given one for (its date).
_RAY_MADE_NAME = re.compile(r"ray_train_run-\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}")
# Ray's elastic resize interval when not given (Train v2): another one is ours to honour.
_RAY_RESIZE_INTERVAL_S = 60.0


def _require(config: object, kind: str, parameter: str) -> None:
    """Refuses anything but Ray's ``kind`` (Train v2's, or v1's and Tune's alike)."""
    cls = type(config)
    if cls.__name__ != kind or cls.__module__.split(".")[0] != "ray":
        raise ConfigError(
            parameter,
            f"{parameter} must be a ray.train.{kind}, got {cls.__name__} {config!r}",
        )


def scaling(config: object) -> dict[str, Any]:
    """A ``ray.train.ScalingConfig`` as RayExecutor's sizing keywords.

    ``num_workers=N`` places N ranks by ``placement_strategy`` (PACK: packed anywhere;
    STRICT_SPREAD: one per node; STRICT_PACK: all on one node); ``num_workers=(min, max)``
    makes the job elastic; ``resources_per_worker`` gives each rank's CPUs and GPUs.

    Raises:
        ConfigError: Not a ScalingConfig, or a field horovod_ray cannot honour.
    """
    _require(config, "ScalingConfig", "scaling_config")
    keywords: dict[str, Any] = {}
    count = config.num_workers
    strategy = config.placement_strategy
    if isinstance(count, tuple):
        if len(count) != 2:
            raise ConfigError(
                "scaling_config.num_workers",
                f"scaling_config.num_workers must be a count or (min, max), got {count!r}",
            )
        for bound in count:
            require_positive("scaling_config.num_workers", bound, integer=True)
        keywords["min_workers"], keywords["max_workers"] = count
        if strategy != "PACK":
            raise ConfigError(
                "scaling_config.placement_strategy",
                f"an elastic job (num_workers=(min, max)) places each rank where there is "
                f"room: leave placement_strategy as PACK, got {strategy!r}",
            )
        interval = getattr(config, "elastic_resize_monitor_interval_s", _RAY_RESIZE_INTERVAL_S)
        if interval != _RAY_RESIZE_INTERVAL_S:  # Ray's default (60 s) leaves horovod_ray's
            require_seconds("scaling_config.elastic_resize_monitor_interval_s", interval)
            keywords["discovery_interval_s"] = interval
    else:
        if count == 0:
            raise ConfigError(
                "scaling_config.num_workers",
                "scaling_config.num_workers=0 runs no ranks: give 1 or more (run(..., "
                "local=True), without scaling_config, runs one rank in this process)",
            )
        if strategy not in _PLACEMENTS:
            raise ConfigError(
                "scaling_config.placement_strategy",
                f"scaling_config.placement_strategy must be one of {sorted(_PLACEMENTS)}, got "
                f"{strategy!r}: Horovod's ranks are placed all at once, packed or spread "
                f"strictly (SPREAD's best effort has no layout here)",
            )
        require_positive("scaling_config.num_workers", count, integer=True)
        keywords.update(_PLACEMENTS[strategy](count))
    if not isinstance(config.use_gpu, bool):
        raise ConfigError(
            "scaling_config.use_gpu",
            f"scaling_config.use_gpu must be True or False, got {config.use_gpu!r} (a Tune "
            f"search space is resolved by a Tuner, not here)",
        )
    keywords["use_gpu"] = config.use_gpu
    keywords.update(_per_worker(config.resources_per_worker, config.use_gpu))
    trainer = getattr(config, "trainer_resources", None)
    if trainer and any(trainer.values()):
        raise ConfigError(
            "scaling_config.trainer_resources",
            f"scaling_config.trainer_resources={trainer!r}: horovod_ray runs no trainer "
            f"actor (the caller drives the job); leave it unset",
        )
    for field, unused in _UNUSED_SCALING.items():
        value = getattr(config, field, unused)
        if value != unused and value not in (None, {}, []):
            raise ConfigError(
                f"scaling_config.{field}",
                f"scaling_config.{field}={value!r} is not supported by horovod_ray; leave "
                f"it unset (ranks reserve CPUs and GPUs: resources_per_worker)",
            )
    return keywords


def _per_worker(resources: object, use_gpu: bool) -> dict[str, Any]:
    if resources is None:
        return {}
    if not isinstance(resources, Mapping):
        raise ConfigError(
            "scaling_config.resources_per_worker",
            f"scaling_config.resources_per_worker must be a dict such as {{'CPU': 2}}, got "
            f"{resources!r}",
        )
    others = sorted(set(resources) - {"CPU", "GPU"})
    if others:
        raise ConfigError(
            "scaling_config.resources_per_worker",
            f"scaling_config.resources_per_worker may hold CPU and GPU, got {others}: "
            f"horovod_ray reserves only those for each rank",
        )
    for amount in resources.values():
        require_positive("scaling_config.resources_per_worker", amount)
    keywords: dict[str, Any] = {}
    if "CPU" in resources:
        keywords["cpus_per_worker"] = resources["CPU"]
    if resources.get("GPU"):
        if not use_gpu:
            raise ConfigError(
                "scaling_config.resources_per_worker",
                "scaling_config.resources_per_worker asks for GPUs without use_gpu=True: "
                "give use_gpu=True",
            )
        keywords["gpus_per_worker"] = resources["GPU"]
    return keywords


def run(config: object) -> dict[str, Any]:
    """A ``ray.train.RunConfig`` (Train's or Tune's) as create_settings' run keywords
    (name, storage, checkpoints) and ``max_restarts`` (its ``FailureConfig``'s
    ``max_failures``, when not 0).

    Raises:
        ConfigError: Not a RunConfig, or a field horovod_ray cannot honour.
    """
    _require(config, "RunConfig", "run_config")
    from ray.train import CheckpointConfig
    from ray.train.constants import DEFAULT_STORAGE_PATH

    # What Ray's RunConfig fills in by itself (Train v2 makes each of these when not
    # given) is not asked: it neither names the run's storage nor clashes with settings
    # that do. A named run keeps Ray's default folder, as Ray Train would.
    given = {
        "storage_path": config.storage_path,
        "name": config.name,
        "storage_filesystem": config.storage_filesystem,
        "checkpoint_config": config.checkpoint_config,
    }
    made_name = isinstance(config.name, str) and _RAY_MADE_NAME.fullmatch(config.name)
    unasked = {
        "name": config.name if made_name else None,
        "storage_path": DEFAULT_STORAGE_PATH if made_name or not config.name else None,
        "checkpoint_config": CheckpointConfig(),
    }
    keywords = {
        name: value
        for name, value in given.items()
        if value is not None and value != unasked.get(name)
    }
    if getattr(config, "stop", None) not in (None, "DEPRECATED"):
        raise ConfigError(
            "run_config.stop",
            "run_config.stop is Tune's stopping rule: a horovod_ray job runs its function "
            "to its end; stop inside it (or give the Tuner its TuneConfig)",
        )
    for field in ("callbacks", "worker_runtime_env"):
        if getattr(config, field, None):
            raise ConfigError(
                f"run_config.{field}",
                f"run_config.{field} is not supported by horovod_ray; leave it unset (the "
                f"ranks' environment: run()'s env, RayExecutor.start(extra_env_vars=))",
            )
    failure = config.failure_config
    if failure is not None:
        _require(failure, "FailureConfig", "run_config.failure_config")
        if failure.max_failures < 0:
            raise ConfigError(
                "run_config.failure_config.max_failures",
                f"run_config.failure_config.max_failures={failure.max_failures} (retry "
                f"forever) is not supported: give the most restarts the job may take",
            )
        if failure.max_failures:  # 0, Ray's default (RunConfig makes one): not asked
            keywords["max_restarts"] = failure.max_failures
    return keywords


def for_tune(config: object) -> Any:
    """A trainer's ``ray.train.RunConfig`` as the ``ray.tune.RunConfig`` a Tuner running
    the trainer takes (Train v2's RunConfig is not Tune's): the same name, storage,
    checkpoint keep policy and failure budget (a trial retried ``max_failures`` times).

    Raises:
        ConfigError: As :func:`run`.
    """
    from ray import tune

    keywords = run(config)
    keep = keywords.get("checkpoint_config")
    if keep is not None:  # Tune's own: Train's marks its unused fields, which Tune refuses
        keep = tune.CheckpointConfig(
            num_to_keep=keep.num_to_keep,
            checkpoint_score_attribute=keep.checkpoint_score_attribute,
            checkpoint_score_order=keep.checkpoint_score_order,
        )
    return tune.RunConfig(
        name=keywords.get("name"),
        storage_path=keywords.get("storage_path"),
        storage_filesystem=keywords.get("storage_filesystem"),
        checkpoint_config=keep,
        failure_config=tune.FailureConfig(max_failures=keywords.get("max_restarts", 0)),
    )


# Ray's HorovodConfig fields that mean something here, and Ray's defaults for them.
_HOROVOD_FIELDS = {"timeout_s": 300, "placement_group_timeout_s": 100, "nics": None, "verbose": 1}


def horovod(horovod_config: object) -> Settings:
    """A ``HorovodTrainer``'s ``horovod_config`` as the job's settings: Ray's
    ``HorovodConfig`` (its ``timeout_s``, ``placement_group_timeout_s``, ``nics``,
    ``verbose``; None: Ray's defaults, a 300 s Gloo timeout among them), or horovod_ray's
    own settings without storage (that is the ``RunConfig``'s).

    Raises:
        ConfigError: Naming the field (``horovod_config.nics``, ...).
    """
    if isinstance(horovod_config, Settings):
        if horovod_config.storage is not None or horovod_config.validation is not None:
            raise ConfigError(
                "horovod_config",
                "horovod_config's settings may not hold storage_path or validation_config: "
                "give the run's storage in run_config=RunConfig(storage_path=..., name=...)",
            )
        return horovod_config
    if horovod_config is None:
        return create_settings(**_HOROVOD_FIELDS)
    _require(horovod_config, "HorovodConfig", "horovod_config")
    keywords = {name: getattr(horovod_config, name) for name in _HOROVOD_FIELDS}
    if isinstance(keywords["nics"], (set, frozenset)) and len(keywords["nics"]) == 1:
        keywords["nics"] = list(keywords["nics"])
    with named_as({name: f"horovod_config.{name}" for name in _HOROVOD_FIELDS}):
        return create_settings(**keywords)


@dataclasses.dataclass(frozen=True)
class FromRay:
    """What a ``ScalingConfig`` and a ``RunConfig`` ask for, as keywords."""

    sizing: dict[str, Any]  # RayExecutor's keywords; empty without a ScalingConfig
    run: dict[str, Any]  # create_settings' and max_restarts; empty without a RunConfig

    @property
    def elastic(self) -> bool:
        return "min_workers" in self.sizing

    def refuse_beside(self, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
        """Refuses keywords given (not at their ``defaults``) beside the config object
        that stands for them: any sizing one beside a ScalingConfig, and beside a
        RunConfig those it sets (``max_restarts`` only with its ``failure_config``)."""
        if self.sizing:
            refuse("scaling_config", SIZING | set(self.sizing), given, defaults)
        refuse("run_config", set(self.run), given, defaults)

    def stored_at(self, storage_path: str) -> FromRay:
        """These, with the run stored under ``storage_path`` unless the RunConfig says
        where."""
        if "storage_path" in self.run:
            return self
        return dataclasses.replace(self, run={**self.run, "storage_path": storage_path})

    def settings(self, settings: Settings) -> Settings:
        """``settings`` with the RunConfig's name and storage (checked as
        create_settings checks them)."""
        run = {k: v for k, v in self.run.items() if k != "max_restarts"}
        if not run:
            return settings
        if settings.storage is not None or settings.name is not None:
            raise ConfigError(
                "run_config",
                f"run_config ({', '.join(sorted(run))}) and the settings' storage_path/name "
                f"both say where the run goes: give one of them",
            )
        made = create_settings(**run)
        return dataclasses.replace(settings, storage=made.storage, name=made.name)


def refuse(
    parameter: str, names: Collection[str], given: Mapping[str, Any], defaults: Mapping[str, Any]
) -> None:
    """Refuses the keywords of ``names`` that are ``given`` (not at their ``defaults``)
    beside the object ``parameter``, which stands for them.

    Raises:
        ConfigError: Naming ``parameter`` and those keywords.
    """
    clashing = [
        name for name, value in given.items() if name in names and not _same(value, defaults[name])
    ]
    if clashing:
        raise ConfigError(
            parameter,
            f"{parameter} and {', '.join(clashing)} both say what the job is: give "
            f"{parameter} alone, or the keywords without it",
        )


def _same(value: object, default: object) -> bool:
    return value is default or (type(value) is type(default) and value == default)


def from_ray(scaling_config: object = None, run_config: object = None) -> FromRay:
    """Both config objects read (None: not given).

    Raises:
        ConfigError: As :func:`scaling` and :func:`run`; or restarts asked of an elastic
            job, which recovers in place instead.
    """
    wanted = FromRay(
        sizing={} if scaling_config is None else scaling(scaling_config),
        run={} if run_config is None else run(run_config),
    )
    if wanted.elastic and wanted.run.get("max_restarts"):
        raise ConfigError(
            "run_config.failure_config.max_failures",
            "an elastic job (scaling_config.num_workers=(min, max)) recovers in place: its "
            "survivors reset and go on, so it takes no restarts; drop failure_config",
        )
    return wanted
