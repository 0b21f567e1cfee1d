"""What a user asks of Ray Data: the datasets by name and Ray Train's ``DataConfig``,
checked before anything is started.

Ray is imported here only when datasets are given: a job without them loads no Ray Data.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

from horovod_ray.errors import ConfigError

if TYPE_CHECKING:
    from ray.data import Dataset
    from ray.train import DataConfig


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The datasets of a job and how they are split.

    Attributes:
        datasets: Name -> the user's ``ray.data.Dataset``.
        config: Ray Train's ``DataConfig``: which datasets are split over the ranks (the
            others go whole to every rank), Ray Data's execution options, locality.
    """

    datasets: Mapping[str, Dataset]
    config: DataConfig

    @property
    def resumable(self) -> bool:
        """Whether the split datasets are split in order, each rank's position kept
        (``horovod_ray.DataConfig(resumable=True)``)."""
        return bool(getattr(self.config, "resumable", False))

    @property
    def split(self) -> frozenset[str]:
        """The names of the datasets split over the ranks."""
        chosen = self.config._datasets_to_split  # Ray's own field: "all" or a list
        return frozenset(self.datasets if chosen == "all" else chosen)


def data_spec(datasets: object, data_config: object) -> DataSpec | None:
    """Checks ``datasets`` and ``data_config`` as ``run()`` and ``RayExecutor`` take them.

    Returns:
        The spec, or None when no datasets are given.

    Raises:
        ConfigError: A parameter that is not what it should be; the message says what.
    """
    if datasets is None:
        if data_config is not None:
            raise ConfigError(
                "data_config", "data_config says how datasets are split: give datasets= too"
            )
        return None
    if not isinstance(datasets, Mapping) or not datasets:
        raise ConfigError(
            "datasets",
            "datasets must be a non-empty dict of name -> ray.data.Dataset, e.g. "
            f"{{'train': ray.data.read_parquet(...)}}, got {datasets!r}",
        )
    from ray.data import Dataset
    from ray.train import DataConfig

    for name, dataset in datasets.items():
        if not isinstance(name, str) or not name:
            raise ConfigError("datasets", f"datasets' names must be non-empty str, got {name!r}")
        if not isinstance(dataset, Dataset):
            raise ConfigError(
                "datasets",
                f"datasets[{name!r}] must be a ray.data.Dataset (ray.data.read_*, "
                f"ray.data.from_*), got {type(dataset).__name__}",
            )
    config = DataConfig() if data_config is None else data_config
    if not isinstance(config, DataConfig):
        raise ConfigError(
            "data_config",
            f"data_config must be a ray.train.DataConfig, got {type(data_config).__name__}",
        )
    spec = DataSpec(dict(datasets), config)
    unknown = sorted(spec.split - set(datasets))
    if unknown:
        raise ConfigError(
            "data_config",
            f"data_config splits {unknown}, which datasets does not have (it has "
            f"{sorted(datasets)}): name only datasets' keys in datasets_to_split",
        )
    return spec


def check_rows(spec: DataSpec, ranks: int) -> None:
    """Refuses a split dataset that is known, without running it, to have fewer rows than
    the job has ranks: each rank would get none. A dataset whose size Ray Data knows only
    once run (after a filter, say) is not counted here.

    Raises:
        ConfigError: Such a dataset, naming it and the fix.
    """
    for name in sorted(spec.split):
        rows = known_rows(spec.datasets[name])
        if rows is not None and rows < ranks:
            raise ConfigError(
                "datasets",
                f"datasets[{name!r}] has {rows} rows for {ranks} ranks: each rank would "
                "get none; give it at least one row per rank, or leave it out of "
                "DataConfig(datasets_to_split=...) so that every rank reads it whole",
            )


def known_rows(dataset: Any) -> int | None:
    """The rows Ray Data knows ``dataset`` has without running it (its metadata), or None."""
    try:
        return dataset._meta_count()  # Ray's own, what Dataset.count() answers first from
    except Exception:  # noqa: BLE001 - a Ray without it: nothing is counted
        return None
