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
    """The datasets of a job and how they are split, checked when made.

    Attributes:
        datasets: Name -> the user's ``ray.data.Dataset``.
        config: Ray Train's ``DataConfig`` (or ``horovod_ray.DataConfig``): which
            datasets are split over the ranks (the others go whole to every rank), Ray
            Data's execution options, locality, whether the split is resumable.

    Raises:
        ConfigError: A field that is not what it should be; the message says what.
    """

    datasets: Mapping[str, Dataset]
    config: DataConfig

    def __post_init__(self) -> None:
        datasets = self.datasets
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
                raise ConfigError(
                    "datasets", f"datasets' names must be non-empty str, got {name!r}"
                )
            if not isinstance(dataset, Dataset):
                raise ConfigError(
                    "datasets",
                    f"datasets[{name!r}] must be a ray.data.Dataset (ray.data.read_*, "
                    f"ray.data.from_*), got {type(dataset).__name__}",
                )
        if not isinstance(self.config, DataConfig):
            raise ConfigError(
                "data_config",
                f"data_config must be a ray.train.DataConfig, got {type(self.config).__name__}",
            )
        object.__setattr__(self, "datasets", dict(datasets))
        unknown = sorted(self.split - set(datasets))
        if unknown:
            raise ConfigError(
                "data_config",
                f"data_config splits {unknown}, which datasets does not have (it has "
                f"{sorted(datasets)}): name only datasets' keys in datasets_to_split",
            )

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
    """``datasets`` and ``data_config`` as ``run()``, ``RayExecutor`` and the Tune adapter
    take them: None without datasets, else the checked spec (Ray's default
    ``DataConfig()`` when none is given).

    Raises:
        ConfigError: ``data_config`` without ``datasets``, or a bad field (``DataSpec``).
    """
    if datasets is None:
        if data_config is not None:
            raise ConfigError(
                "data_config", "data_config says how datasets are split: give datasets= too"
            )
        return None
    if data_config is None:
        from ray.train import DataConfig

        data_config = DataConfig()
    return DataSpec(datasets, data_config)  # type: ignore[arg-type]


def check_rows(spec: DataSpec, num_ranks: int) -> None:
    """Refuses a split dataset that is known, without running it, to have fewer rows than
    the job has ranks: each rank would get none. A dataset whose size Ray Data knows only
    once run (after a filter, say) is not counted here.

    Raises:
        ConfigError: Such a dataset, naming it and the fix.
    """
    for name in sorted(spec.split):
        rows = known_rows(spec.datasets[name])
        if rows is not None and rows < num_ranks:
            raise ConfigError(
                "datasets",
                f"datasets[{name!r}] has {rows} rows for {num_ranks} ranks: each rank would "
                "get none; give it at least one row per rank, or leave it out of "
                "DataConfig(datasets_to_split=...) so that every rank reads it whole",
            )


def known_rows(dataset: Any) -> int | None:
    """The rows Ray Data knows ``dataset`` has without running it (its metadata), or None."""
    try:
        return dataset._meta_count()  # Ray's own, what Dataset.count() answers first from
    except Exception:  # noqa: BLE001 - a Ray without it: nothing is counted
        return None
