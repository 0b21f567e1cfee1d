"""What a run's checkpoints are asked to be: where, under which name, how many kept.

:class:`RunStorage` is validated when it is made (``create_settings(storage_path=...)``),
so a bad value is a ``ConfigError`` naming the parameter before Ray is touched. It travels
to every rank in one environment variable, so a rank started by the command line's
``python`` commands finds it too.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import numbers
import os
import time
from typing import TYPE_CHECKING, Any

import cloudpickle

from horovod_ray.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow.fs

# Set on every rank of a job with a storage path: the run's storage, as JSON.
STORAGE_ENV = "HOROVOD_RAY_STORAGE"
# Set with it: the committed checkpoint this job starts from ("" for none).
CHECKPOINT_ENV = "HOROVOD_RAY_CHECKPOINT"
# And the first number free when the job started: an unfinished folder below it is an
# upload of an earlier job cut off; one above it may be this job's, still uploading.
FIRST_INDEX_ENV = "HOROVOD_RAY_CHECKPOINT_FIRST"
ORDERS = ("max", "min")


@dataclasses.dataclass(frozen=True)
class RunStorage:
    """A run's folder and what to keep in it.

    Attributes:
        filesystem: Where the run's folder is (pyarrow).
        run_path: The run's folder on ``filesystem``: ``storage_path/name``.
        name: The run's name.
        num_to_keep: Checkpoints kept (the best by the score, and always the latest);
            None keeps all.
        score_attribute: The reported metric that ranks checkpoints; None ranks by age.
        score_order: ``"max"`` (higher is better) or ``"min"``.
    """

    filesystem: pyarrow.fs.FileSystem
    run_path: str
    name: str
    num_to_keep: int | None = None
    score_attribute: str | None = None
    score_order: str = "max"
    # The URI the filesystem was read from, ``storage_path`` as given (the ranks open it
    # again, with their own credentials); None: the filesystem travels pickled.
    uri: str | None = None

    def to_env(self, checkpoint_path: str | None, first_index: int = 1) -> dict[str, str]:
        """The ranks' environment for this storage, for a job starting from
        ``checkpoint_path`` when ``first_index`` is the first number free."""
        spec: dict[str, Any] = {
            "run_path": self.run_path,
            "name": self.name,
            "num_to_keep": self.num_to_keep,
            "score_attribute": self.score_attribute,
            "score_order": self.score_order,
            "filesystem": None,
            "uri": None,
        }
        if self.uri is None:
            spec["filesystem"] = base64.b64encode(cloudpickle.dumps(self.filesystem)).decode()
        else:
            spec["uri"] = self.uri
        return {
            STORAGE_ENV: json.dumps(spec),
            CHECKPOINT_ENV: checkpoint_path or "",
            FIRST_INDEX_ENV: str(first_index),
        }

    @classmethod
    def from_env(cls, environ: dict[str, str] | os._Environ = os.environ) -> RunStorage | None:
        """The storage a rank's job was given; None without one."""
        text = environ.get(STORAGE_ENV)
        if not text:
            return None
        spec = json.loads(text)
        import pyarrow.fs  # here: only a job with a storage pays for it

        if spec["uri"] is None:
            filesystem = cloudpickle.loads(base64.b64decode(spec["filesystem"]))
        else:
            filesystem, _ = pyarrow.fs.FileSystem.from_uri(spec["uri"])
        return cls(
            filesystem=filesystem,
            run_path=spec["run_path"],
            name=spec["name"],
            num_to_keep=spec["num_to_keep"],
            score_attribute=spec["score_attribute"],
            score_order=spec["score_order"],
            uri=spec["uri"],
        )


def default_name() -> str:
    """A new run's name when none is given: ``horovod_ray_`` and the time, as Ray names
    its runs."""
    return time.strftime("horovod_ray_%Y-%m-%d_%H-%M-%S")


def create(
    storage_path: str | os.PathLike | None,
    name: str | None = None,
    checkpoint_config: Any = None,
    storage_filesystem: pyarrow.fs.FileSystem | None = None,
) -> RunStorage | None:
    """Checks the checkpoint parameters and builds the run's storage; None without a
    ``storage_path``.

    Args:
        storage_path: A local folder, a URI (``s3://bucket/runs``, ``file:///mnt/nfs``), or
            with ``storage_filesystem``, a path on it.
        name: The run's folder under ``storage_path``; None makes one from the time. Give
            the same name again to resume.
        checkpoint_config: A ``ray.train.CheckpointConfig`` (``num_to_keep``,
            ``checkpoint_score_attribute``, ``checkpoint_score_order``).
        storage_filesystem: A ``pyarrow.fs.FileSystem`` that ``storage_path`` is on.

    Raises:
        ConfigError: A bad value, naming the parameter.
    """
    if storage_path is None:
        # ``name`` alone names the job (its metrics, ``horovod-ray status``).
        for parameter, value in (
            ("checkpoint_config", checkpoint_config),
            ("storage_filesystem", storage_filesystem),
        ):
            if value is not None:
                raise ConfigError(
                    parameter,
                    f"{parameter} is given but storage_path is not: give storage_path (a "
                    f"folder or a URI such as s3://bucket/runs) for checkpoints to persist",
                )
        return None
    if isinstance(storage_path, os.PathLike):
        storage_path = os.fspath(storage_path)
    if not isinstance(storage_path, str) or not storage_path:
        raise ConfigError(
            "storage_path",
            f"storage_path must be a folder or a URI (str), got {storage_path!r}",
        )
    name = default_name() if name is None else name
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name:
        raise ConfigError("name", f"name must be a folder name (a str without '/'), got {name!r}")
    keep, attribute, order = _checkpoint_config(checkpoint_config)
    filesystem, root = filesystem_of(storage_path, storage_filesystem)
    if storage_filesystem is not None:
        try:  # now, not when the first job starts: it travels to the ranks pickled
            cloudpickle.dumps(storage_filesystem)
        except Exception as err:
            raise ConfigError(
                "storage_filesystem",
                f"storage_filesystem cannot be pickled to send to the ranks: "
                f"{type(err).__name__}: {err}",
            ) from err
    # A URI travels as the user gave it: the ranks open the same filesystem from it (query
    # included: an S3 region, an endpoint) and find the run at run_path, which travels
    # beside it. The name is never put into the URI, where a space, a '%' or a '#' would
    # not parse, or would cut the query off. A filesystem object (given, or the local
    # one) travels pickled.
    uri = storage_path if storage_filesystem is None and "://" in storage_path else None
    return RunStorage(
        filesystem=filesystem,
        run_path=f"{root.rstrip('/')}/{name}",
        name=name,
        num_to_keep=keep,
        score_attribute=attribute,
        score_order=order,
        uri=uri,
    )


def filesystem_of(
    storage_path: str, storage_filesystem: object, parameter: str = "storage_path"
) -> tuple[pyarrow.fs.FileSystem, str]:
    """The filesystem ``storage_path`` is on and the path on it: ``storage_filesystem``
    when given, else the URI's, else the local one (the path made absolute). Errors name
    ``parameter`` (the caller's name for the path)."""
    import pyarrow.fs  # here: only a job with a storage pays for it

    if storage_filesystem is not None:
        if not isinstance(storage_filesystem, pyarrow.fs.FileSystem):
            raise ConfigError(
                "storage_filesystem",
                f"storage_filesystem must be a pyarrow.fs.FileSystem, got "
                f"{type(storage_filesystem).__name__}",
            )
        return storage_filesystem, storage_path
    if "://" not in storage_path:
        return pyarrow.fs.LocalFileSystem(), os.path.abspath(os.path.expanduser(storage_path))
    try:
        return pyarrow.fs.FileSystem.from_uri(storage_path)
    except (pyarrow.ArrowException, OSError, ValueError) as err:
        raise ConfigError(
            parameter,
            f"{parameter} {storage_path!r} is not a URI pyarrow can open ({err}); give a "
            f"local folder, or a URI such as s3://bucket/runs or file:///mnt/nfs/runs",
        ) from err


def _checkpoint_config(config: Any) -> tuple[int | None, str | None, str]:
    """``num_to_keep``, ``checkpoint_score_attribute`` and ``checkpoint_score_order`` of a
    ``ray.train.CheckpointConfig`` (any object with those attributes), checked."""
    if config is None:
        return None, None, "max"
    fields = ("num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order")
    if not all(hasattr(config, field) for field in fields):
        raise ConfigError(
            "checkpoint_config",
            f"checkpoint_config must be a ray.train.CheckpointConfig, got {type(config).__name__}",
        )
    keep = config.num_to_keep
    if keep is not None and (
        not isinstance(keep, numbers.Integral) or isinstance(keep, bool) or keep < 1
    ):
        raise ConfigError(
            "checkpoint_config",
            f"checkpoint_config.num_to_keep must be None (keep all) or an integer >= 1, "
            f"got {keep!r}",
        )
    attribute = config.checkpoint_score_attribute
    if attribute is not None and not isinstance(attribute, str):
        raise ConfigError(
            "checkpoint_config",
            f"checkpoint_config.checkpoint_score_attribute must be a metric's name, got "
            f"{attribute!r}",
        )
    order = config.checkpoint_score_order
    if order not in ORDERS:
        raise ConfigError(
            "checkpoint_config",
            f"checkpoint_config.checkpoint_score_order must be 'max' or 'min', got {order!r}",
        )
    return None if keep is None else int(keep), attribute, order
