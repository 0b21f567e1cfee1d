"""A run's folder read back by the driver: :class:`Result` (``horovod_ray.Result``)."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from horovod_ray.checkpoints import choices, files, spec, store
from horovod_ray.checkpoints.metrics import flatten
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import pyarrow.fs


def _storage_at(path: object, filesystem: object) -> RunStorage:
    """The run's folder at ``path`` as a storage to read (nothing to keep)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str) or not path:
        raise ConfigError("path", f"path must be a run's folder or URI (str), got {path!r}")
    filesystem, run_path = spec.filesystem_of(path, filesystem, parameter="path")
    run_path = run_path.rstrip("/")
    return RunStorage(filesystem, run_path, run_path.rpartition("/")[2])


def _require_folder(storage: RunStorage, path: object) -> None:
    """Raises unless the run's folder is there (as Ray's ``Result.from_path`` does).

    Raises:
        ConfigError: It does not exist, or is a file.
        CheckpointError: The storage could not be read.
    """
    import pyarrow.fs

    try:
        kind = storage.filesystem.get_file_info(storage.run_path).type
    except files.storage_errors() as err:
        raise CheckpointError(
            f"could not read {storage.run_path}: {type(err).__name__}: {err}"
        ) from err
    if kind != pyarrow.fs.FileType.Directory:
        if kind == pyarrow.fs.FileType.File:
            what = "is a file: give a run's folder"
        else:  # made at the run's first report
            what = "does not exist: nothing was reported there yet, or give a run's folder"
        raise ConfigError(
            "path",
            f"path {os.fspath(path)!r} {what}, storage_path/name as given to run() or "
            f"create_settings()",
        )


@dataclasses.dataclass(frozen=True)
class Result:
    """What a run left in its folder, read back (by the driver, after or during a run).

    Attributes:
        path: The run's folder (``storage_path/name``) on ``filesystem``.
        filesystem: The pyarrow filesystem it is on.
        metrics: The last metrics reported (with or without a checkpoint); {} if none.
        checkpoint: The latest committed checkpoint (``ray.train.Checkpoint``), or None.
        best_checkpoints: Every committed checkpoint kept, with its metrics, oldest
            first (as Ray Train's ``Result.best_checkpoints``).
    """

    path: str
    filesystem: pyarrow.fs.FileSystem
    metrics: dict
    checkpoint: Any
    best_checkpoints: list

    @classmethod
    def from_path(
        cls, path: str, storage_filesystem: pyarrow.fs.FileSystem | None = None
    ) -> Result:
        """Reads the run at ``path`` (``storage_path/name``, as given to ``run()``): a
        local folder, a URI (``s3://bucket/runs/name``), or a path on
        ``storage_filesystem``.

        Raises:
            ConfigError: ``path`` or ``storage_filesystem`` is not valid, or there is no
                folder at ``path``.
            CheckpointError: The run's folder could not be read.
        """
        storage = _storage_at(path, storage_filesystem)
        _require_folder(storage, path)
        entries = store.list_entries(storage)
        record = files.read_json(storage, choices.METRICS_FILE)
        metrics = record.get("metrics", {}) if isinstance(record, dict) else {}
        newest = choices.latest(entries)
        return cls(
            path=storage.run_path,
            filesystem=storage.filesystem,
            metrics=metrics,
            checkpoint=None if newest is None else store.as_checkpoint(storage, newest),
            best_checkpoints=[
                (store.as_checkpoint(storage, entry), entry.metrics)
                for entry in entries
                if entry.committed
            ],
        )

    def get_best_checkpoint(self, metric: str, mode: str) -> Any:
        """The kept checkpoint with the best ``metric`` (a nested one by its path,
        ``"val/loss"``), the oldest of equals, as Ray Train's
        ``Result.get_best_checkpoint``.

        Args:
            metric: The metric's name.
            mode: ``"max"`` (higher is better) or ``"min"``.

        Raises:
            ConfigError: ``mode`` is neither, or no kept checkpoint has ``metric`` as a
                number (Ray raises RuntimeError for that), naming it.
        """
        if mode not in spec.ORDERS:
            raise ConfigError("mode", f"mode must be 'max' or 'min', got {mode!r}")
        scored = [
            (value, number)
            for number, (_, metrics) in enumerate(self.best_checkpoints)
            if (value := choices.score(metrics, metric)) is not None
        ]
        if not scored:
            reported = sorted({key for _, m in self.best_checkpoints for key in flatten(m)})
            raise ConfigError(
                "metric",
                f"no checkpoint kept in {self.path} has {metric!r} as a number; their "
                f"metrics: {reported}",
            )
        _, number = (max if mode == "max" else min)(scored, key=lambda pair: pair[0])
        return self.best_checkpoints[number][0]
