"""A run's folder: its checkpoints, which of them count, which are kept.

Layout, under ``storage_path/name``::

    checkpoint_000003/        the files rank 0 reported (as they were)
    checkpoint_000003.json    the commit marker: written last, holds the metrics
    epoch_7/                  checkpoint 4, in the folder report(checkpoint_dir_name=...) named
    checkpoint_000004.json    its marker, which names its folder
    metrics.json              the last metrics reported, with or without a checkpoint

A marker also records a validation asked for with the checkpoint (``validation``): the
driver's ``Validator`` writes its outcome into it, metrics merged.

Checkpoints are numbered in the order they are committed, whatever their folders' names;
a marker names its folder when that is not ``checkpoint_`` and the number. A checkpoint
folder without its marker is an upload that did not finish (the job failed during it):
it is never taken as the latest, and the next commit removes it. A named folder is
uploaded after a marker without metrics (not committed) that names it, so that an upload
cut off there is found and removed as well. The JSON
files are written under a temporary name and moved into place, so a reader never sees
half of one (a marker that cannot be read anyway counts as missing). Removing a
checkpoint removes the marker first, so a half-removed one is no longer taken either.
The choices (latest, next number, what to remove) are pure functions over
:class:`Entry` records, in ``entries``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from horovod_ray.checkpoints.choices import (
    METRICS_FILE,
    PENDING_VALIDATION,
    Entry,
    dir_name_problem,
    folder_name,
    index_of,
    marker_name,
    next_index,
    parse_name,
    stale_partials,
    to_remove,
)
from horovod_ray.checkpoints.files import (
    failed,
    listing,
    read_json,
    storage_errors,
    write_json,
)
from horovod_ray.checkpoints.metrics import encoded
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import CheckpointError

if TYPE_CHECKING:
    import pyarrow.fs

logger = logging.getLogger(__name__)


def index_at(storage: RunStorage, path: str | None) -> int | None:
    """The number of the run's checkpoint at ``path``, a numbered folder or a named one
    (read from the markers), or None.

    Raises:
        CheckpointError: The storage could not be read.
    """
    if not path or index_of(path) is not None:
        return index_of(path)
    path = path.rstrip("/")
    found = (e.index for e in list_entries(storage) if checkpoint_path(storage, e) == path)
    return next(found, None)


# ------------------------------------------------------------------- the filesystem


def list_entries(
    storage: RunStorage,
    infos: list[pyarrow.fs.FileInfo] | None = None,
    skip: frozenset[int] | set[int] = frozenset(),
) -> list[Entry]:
    """The checkpoints in the run's folder (none if it does not exist yet), from its
    listing ``infos`` when the caller has one; those numbered in ``skip`` are left out,
    their markers unread.

    Raises:
        CheckpointError: The storage could not be read.
    """
    import pyarrow.fs

    infos = listing(storage) if infos is None else infos
    folders, markers = set(), set()
    for info in infos:
        parsed = parse_name(info.base_name)
        if parsed is None:
            continue
        index, is_marker = parsed
        if is_marker and info.type == pyarrow.fs.FileType.File:
            markers.add(index)
        elif not is_marker and info.type == pyarrow.fs.FileType.Directory:
            folders.add(index)
    entries = []
    for index in sorted((folders | markers) - set(skip)):
        marker = read_json(storage, marker_name(index)) if index in markers else None
        marker = marker if isinstance(marker, dict) else {}
        committed = isinstance(marker.get("metrics"), dict)
        named = marker.get("folder")
        named = named if dir_name_problem(named) is None else None
        if named is not None and index in folders:
            # Two processes chose the same number (see commit): the numbered folder is
            # the entry's, and the named one is left for the user to see.
            logger.warning(
                "checkpoint %d has both %s and, by its marker, %s: %s counts",
                index, folder_name(index), named, folder_name(index),
            )  # fmt: skip
            named = None
        validation = marker.get("validation")
        validation = validation if committed and isinstance(validation, dict) else {}
        metrics = marker["metrics"] if committed else {}
        written = marker.get("time") if committed else None
        entries.append(Entry(index, committed, metrics, named, validation, written))
    return entries


def checkpoint_path(storage: RunStorage, entry: Entry) -> str:
    return f"{storage.run_path}/{entry.folder}"


def commit(
    storage: RunStorage,
    local_dir: str | None,
    metrics: dict,
    protected: int | None = None,
    stale_below: int = 1,
    upload_fn: Any = None,
    dir_name: str | None = None,
    validation: dict | None = None,
) -> int:
    """Uploads ``local_dir`` as the run's next checkpoint, then writes its marker, then
    removes what the run no longer keeps (see :func:`to_remove`). With ``dir_name``, in
    that folder of the run's; with ``local_dir`` None too, the checkpoint is already
    there (``NO_UPLOAD``): only its marker is written.

    The number is chosen now, past every folder there, so that a restarted job or a new
    driver never writes into an earlier one. Two processes committing at the same moment
    (in an elastic job, the rank that was 0 and the one that is) can still choose the
    same number: storage has no atomic "create if absent" to rule it out.

    Args:
        storage: The run's storage.
        local_dir: The staged checkpoint.
        metrics: The metrics reported with it.
        protected: A number the keep policy must not remove (the job's start).
        stale_below: The job's first number (see :func:`to_remove`).
        upload_fn: ``report(checkpoint_upload_fn=...)``: called with the staged
            checkpoint and its destination folder instead of pyarrow's copy.
        dir_name: ``report(checkpoint_dir_name=...)``: the checkpoint's folder in the
            run's (see :func:`dir_name_problem`).
        validation: ``report(validation=...)``'s request (``validation.task_request``):
            the marker records it as pending, for the driver's ``Validator``.

    Returns:
        The checkpoint's number.

    Raises:
        CheckpointError: A read or write failed; what was there before stays as it was
            (a half-uploaded folder has no marker). ``dir_name`` is another committed
            checkpoint's folder, or (``local_dir`` None) not a folder in the run's.
            Removing what is no longer kept is not part of the commit: a failure there is
            logged.
    """
    entries = list_entries(storage)
    index = next_index(entries)
    entry = Entry(index, True, metrics, dir_name)
    destination = checkpoint_path(storage, entry)
    # Encoded before anything is uploaded: metrics that cannot be stored fail here, not
    # after the files, where they would leave a folder without its marker.
    fields: dict[str, Any] = {"index": index, "metrics": metrics, "time": time.time()}
    if dir_name is not None:
        fields["folder"] = dir_name
    if validation is not None:
        fields["validation"] = {"status": PENDING_VALIDATION, "request": validation}
    marker = encoded(fields)
    try:
        if dir_name is not None:
            _make_room(storage, entries, entry, stale_below, in_place=local_dir is None)
        if local_dir is None:
            _check_in_place(storage, destination)
        else:
            if dir_name is not None:  # so that an upload cut off is found, and removed
                storage.filesystem.create_dir(storage.run_path, recursive=True)
                pending = {"index": index, "folder": dir_name, "time": time.time()}
                write_json(storage, marker_name(index), encoded(pending))
            _upload(local_dir, storage, destination, upload_fn)
        write_json(storage, marker_name(index), marker)
    except storage_errors() as err:
        raise failed("upload checkpoint to", destination, err) from err
    _remove_unkept(storage, stale_below, protected)
    return index


def _upload(local_dir: str, storage: RunStorage, destination: str, upload_fn: Any) -> None:
    import pyarrow.fs

    if upload_fn is not None:
        _upload_with(upload_fn, local_dir, destination)
        return
    storage.filesystem.create_dir(destination, recursive=True)
    pyarrow.fs.copy_files(
        local_dir,
        destination,
        source_filesystem=pyarrow.fs.LocalFileSystem(),
        destination_filesystem=storage.filesystem,
    )


def _check_in_place(storage: RunStorage, destination: str) -> None:
    import pyarrow.fs

    if storage.filesystem.get_file_info(destination).type != pyarrow.fs.FileType.Directory:
        raise CheckpointError(
            f"a NO_UPLOAD checkpoint must be a folder in the run's when it is committed, "
            f"after the uploads reported before it: {destination} is not one (keep the "
            f"folder once report() returns; it is the checkpoint)"
        )


def _make_room(
    storage: RunStorage, entries: list[Entry], entry: Entry, stale_below: int, in_place: bool
) -> None:
    """Before checkpoint ``entry`` is committed in its named folder: an earlier job's
    upload to that folder that was cut off (not committed, numbered below
    ``stale_below``) is removed, its marker, and its folder unless ``in_place`` (a
    ``NO_UPLOAD`` checkpoint's own files are there now).

    Raises:
        CheckpointError: That folder is a committed checkpoint's, or an upload of this
            job's is under way to it (an elastic job's former rank 0), or (not
            ``in_place``) a folder there that is no checkpoint's has the name.
    """
    import pyarrow.fs

    name = entry.folder
    same = [e for e in entries if e.folder.casefold() == name.casefold()]
    for other in same:
        if other.committed or other.index >= stale_below:
            state = "is checkpoint" if other.committed else "is being uploaded as checkpoint"
            raise CheckpointError(
                f"checkpoint folder {name!r} {state} {other.index}'s in {storage.run_path}: "
                f"give each checkpoint a checkpoint_dir_name of its own (e.g. with its epoch)"
            )
    for other in same:
        remove(storage, other, with_folder=not in_place)
    destination = checkpoint_path(storage, entry)
    if not in_place and storage.filesystem.get_file_info(destination).type != (
        pyarrow.fs.FileType.NotFound
    ):
        raise CheckpointError(
            f"checkpoint_dir_name {name!r} is a folder in {storage.run_path} that is no "
            f"checkpoint's: choose another name (a checkpoint's folder holds only its files)"
        )


def _upload_with(upload_fn: Any, local_dir: str, destination: str) -> None:
    """The user's upload of ``local_dir`` to ``destination``, whose result must be there.

    Raises:
        CheckpointError: It raised, or returned a checkpoint elsewhere.
    """
    from ray.train import Checkpoint

    try:
        uploaded = upload_fn(Checkpoint.from_directory(local_dir), destination)
    except Exception as err:
        raise CheckpointError(f"checkpoint_upload_fn raised: {type(err).__name__}: {err}") from err
    path = getattr(uploaded, "path", None)
    if path is None or path.rstrip("/") != destination.rstrip("/"):
        raise CheckpointError(
            f"checkpoint_upload_fn must upload to the destination it is given and return "
            f"it (Checkpoint({destination!r}, filesystem=...)), got {uploaded!r}"
        )


def prune(storage: RunStorage, first_index: int | None = None) -> None:
    """Applies the keep policy once a job has ended: its starting checkpoint is no longer
    protected, and an unfinished folder is an upload that was cut off. ``first_index``:
    the ended job's first number, below which a cut-off upload to a named folder is an
    earlier job's (see :func:`_remove_unkept`); None: unknown, every such folder goes."""
    _remove_unkept(storage, stale_below=None, protected=None, first_index=first_index)


def _remove_unkept(
    storage: RunStorage,
    stale_below: int | None,
    protected: int | None,
    first_index: int | None = None,
) -> None:
    """Removes what :func:`to_remove` says (``stale_below`` None: every unfinished
    folder), and the JSON files a killed process left half-written (see
    :func:`stale_partials`). A storage that fails here is logged, not raised: the
    checkpoints that count are already there, and the job's own outcome is what its
    caller needs.

    A folder another checkpoint kept still names stays. An earlier job's cut-off upload
    to a named folder (numbered below the job's first number: ``stale_below`` while it
    runs, ``first_index`` once it ended) loses only its marker: the job's start removed
    that folder (``job.job_env``), and the name may hold a ``NO_UPLOAD`` checkpoint of
    this job's by now, which stays even if it was never committed."""
    try:
        infos = listing(storage)  # once: a listing is a request to a cloud storage
        entries = list_entries(storage, infos)
        below = next_index(entries) if stale_below is None else stale_below
        by_index = {entry.index: entry for entry in entries}
        removed = to_remove(
            entries,
            storage.num_to_keep,
            storage.score_attribute,
            storage.score_order,
            below,
            protected,
        )
        kept = {e.folder.casefold() for e in entries if e.index not in set(removed)}
        first = stale_below if stale_below is not None else first_index
        for index in removed:
            entry = by_index[index]
            earlier_jobs_named = (
                not entry.committed
                and entry.named is not None
                and first is not None
                and entry.index < first
            )
            with_folder = entry.folder.casefold() not in kept and not earlier_jobs_named
            remove(storage, entry, with_folder=with_folder)
        names = [info.base_name for info in infos]
        for name in stale_partials(names, stale_below):
            with contextlib.suppress(FileNotFoundError):
                storage.filesystem.delete_file(f"{storage.run_path}/{name}")
    except Exception as err:  # noqa: BLE001 - any filesystem's error, see above
        logger.warning("the run's old checkpoints were not removed: %s", err)


def write_metrics(storage: RunStorage, metrics: dict) -> None:
    """Records ``metrics`` as the run's last reported ones."""
    try:
        storage.filesystem.create_dir(storage.run_path, recursive=True)
        write_json(storage, METRICS_FILE, encoded({"metrics": metrics, "time": time.time()}))
    except storage_errors() as err:
        raise failed("write", f"{storage.run_path}/{METRICS_FILE}", err) from err


def remove(storage: RunStorage, entry: Entry, with_folder: bool = True) -> None:
    """Removes a checkpoint: its marker first, so it stops counting at once, then its
    folder (unless not ``with_folder``)."""
    fs, path = storage.filesystem, checkpoint_path(storage, entry)
    marker = f"{storage.run_path}/{marker_name(entry.index)}"
    try:
        fs.delete_file(marker)
    except FileNotFoundError:
        pass
    except storage_errors() as err:
        raise failed("remove", marker, err) from err
    if not with_folder:
        return
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass
    except storage_errors() as err:
        raise failed("remove", path, err) from err


def as_checkpoint(storage: RunStorage, entry: Entry) -> Any:
    """A checkpoint of the run's as a ``ray.train.Checkpoint`` on its filesystem."""
    from ray.train import Checkpoint  # here: ray.train takes seconds to import

    return Checkpoint(checkpoint_path(storage, entry), filesystem=storage.filesystem)
