"""What ``report()``'s upload options (Ray Train 2.60's) mean for one checkpoint, checked
before anything is staged: which are refused, and where a checkpoint's folder may be
(one in the run's storage is never deleted; a ``NO_UPLOAD`` one must be there)."""

from __future__ import annotations

import os
from typing import Any

from horovod_ray.checkpoints import choices
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import ConfigError


def upload_options(
    dir_name: Any, mode: Any, delete_local: Any, upload_fn: Any
) -> tuple[bool, bool, bool]:
    """Checks ``ray.train.report``'s upload parameters; whether the upload is synchronous,
    whether the checkpoint's folder goes once copied, and whether it is committed where
    it is (``NO_UPLOAD``).

    Raises:
        ConfigError: A parameter this package does not honour, or a bad value, named,
            with what to do.
    """
    problem = None if dir_name is None else choices.dir_name_problem(dir_name)
    if problem is not None:
        raise ConfigError("checkpoint_dir_name", f"checkpoint_dir_name {problem}")
    if upload_fn is not None and not callable(upload_fn):
        raise ConfigError(
            "checkpoint_upload_fn",
            f"checkpoint_upload_fn must be a function (checkpoint, destination) -> Checkpoint, "
            f"got {upload_fn!r}",
        )
    if delete_local not in (None, True, False):
        raise ConfigError(
            "delete_local_checkpoint_after_upload",
            f"delete_local_checkpoint_after_upload must be True, False or None, got "
            f"{delete_local!r}",
        )
    value = None if mode is None else getattr(mode, "value", mode)
    if value not in (None, "SYNC", "ASYNC", "NO_UPLOAD"):
        raise ConfigError(
            "checkpoint_upload_mode",
            f"checkpoint_upload_mode must be CheckpointUploadMode.SYNC, ASYNC or NO_UPLOAD, "
            f"got {mode!r}",
        )
    if value == "NO_UPLOAD":
        for name, given in (
            ("checkpoint_upload_fn", upload_fn is not None),
            ("delete_local_checkpoint_after_upload", bool(delete_local)),
        ):
            if given:
                raise ConfigError(
                    name,
                    f"with NO_UPLOAD the checkpoint is already in the run's storage, and is "
                    f"neither uploaded nor deleted: leave {name} out",
                )
    if delete_local is None:
        delete_local = value == "ASYNC"  # Ray's default for each mode
    return value == "SYNC", delete_local, value == "NO_UPLOAD"


def on_this_node(checkpoint: Any) -> bool:
    import pyarrow.fs

    return isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem)


def outside_the_run(checkpoint: Any, storage: RunStorage) -> None:
    """Refuses to delete a folder in the run's storage (a checkpoint read back and
    reported again), or one that holds it, as Ray refuses.

    Raises:
        ConfigError: Naming delete_local_checkpoint_after_upload.
    """
    if in_the_run(checkpoint, storage):
        raise ConfigError(
            "delete_local_checkpoint_after_upload",
            f"the checkpoint's folder {checkpoint.path} is in the run's storage "
            f"({os.path.realpath(storage.run_path)}) or holds it: report a copy, or leave "
            f"delete_local_checkpoint_after_upload False",
        )


def in_the_run(checkpoint: Any, storage: RunStorage) -> bool:
    """Whether a checkpoint's folder on this node is in the run's (local) storage, or
    holds it."""
    import pyarrow.fs

    if not on_this_node(checkpoint):
        return False
    if not isinstance(storage.filesystem, pyarrow.fs.LocalFileSystem):
        return False
    folder = os.path.realpath(checkpoint.path)
    run = os.path.realpath(storage.run_path)
    return os.path.commonpath([folder, run]) in (folder, run)


def folder_in_the_run(checkpoint: Any, storage: RunStorage, dir_name: str | None) -> str:
    """The name of a ``NO_UPLOAD`` checkpoint's folder, which must be one in the run's
    folder (on its filesystem) and have a name a checkpoint may have.

    Raises:
        ConfigError: It is elsewhere (``checkpoint``), or ``dir_name`` is not its name.
    """
    path = checkpoint.path.rstrip("/")
    parent, _, name = path.rpartition("/")
    run = storage.run_path.rstrip("/")
    if on_this_node(checkpoint) and _local_storage(storage):
        # The folder itself resolved: a link in the run's to a folder elsewhere is not in it.
        resolved = os.path.realpath(path)
        run = os.path.realpath(run)
        parent = os.path.dirname(resolved) if os.path.basename(resolved) == name else None
    same_fs = checkpoint.filesystem.type_name == storage.filesystem.type_name
    if not same_fs or parent != run:
        raise ConfigError(
            "checkpoint",
            f"a NO_UPLOAD checkpoint must be a folder in the run's folder itself, not deeper "
            f"nor a link elsewhere ({storage.run_path} on {storage.filesystem.type_name}: "
            f"get_context().get_storage()), got {path} on {checkpoint.filesystem.type_name}: "
            f"write it there, or let report() upload it",
        )
    problem = choices.dir_name_problem(name)
    if problem is not None:
        raise ConfigError("checkpoint", f"a NO_UPLOAD checkpoint's folder {problem}")
    if dir_name is not None and dir_name != name:
        raise ConfigError(
            "checkpoint_dir_name",
            f"a NO_UPLOAD checkpoint stays in its folder {name!r}: leave checkpoint_dir_name "
            f"out, or give that name",
        )
    return name


def _local_storage(storage: RunStorage) -> bool:
    import pyarrow.fs

    return isinstance(storage.filesystem, pyarrow.fs.LocalFileSystem)


def refuse_under_tune(
    dir_name: Any, mode: Any, delete_local: Any, upload_fn: Any, validation: Any
) -> None:
    """Under Tune the trial's checkpoint goes through Tune's own report.

    Raises:
        ConfigError: Naming an upload option Tune's report does not take.
    """
    for name, given in (
        ("checkpoint_dir_name", dir_name is not None),
        ("checkpoint_upload_mode", mode is not None),
        ("delete_local_checkpoint_after_upload", delete_local is not None),
        ("checkpoint_upload_fn", upload_fn is not None),
        ("validation", validation not in (None, False)),
    ):
        if given:
            raise ConfigError(
                name,
                f"in a Tune trial report() hands the checkpoint to Tune, which persists it "
                f"in the trial's storage: leave {name} out",
            )
