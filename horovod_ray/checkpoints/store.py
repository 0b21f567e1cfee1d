"""A run's folder: its checkpoints, which of them count, which are kept.

Layout, under ``storage_path/name``::

    checkpoint_000003/        the files rank 0 reported (as they were)
    checkpoint_000003.json    the commit marker: written last, holds the metrics
    metrics.json              the last metrics reported, with or without a checkpoint

A checkpoint folder without its marker is an upload that did not finish (the job failed
during it): it is never taken as the latest, and the next commit removes it. The JSON
files are written under a temporary name and moved into place, so a reader never sees
half of one (a marker that cannot be read anyway counts as missing). Removing a
checkpoint removes the marker first, so a half-removed one is no longer taken either.
The choices (latest, next number, what to remove) are pure functions over
:class:`Entry` records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
from typing import TYPE_CHECKING, Any, Iterable

from horovod_ray.checkpoints.metrics import encoded, flatten
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import CheckpointError

if TYPE_CHECKING:
    import pyarrow.fs

logger = logging.getLogger(__name__)


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a pyarrow filesystem raises when it fails (pyarrow is imported only when a
    storage is used: it adds a quarter of a second to every rank's start)."""
    import pyarrow

    return (OSError, pyarrow.ArrowException)


_NAME = re.compile(r"^checkpoint_(\d{6,})(\.json)?$")
METRICS_FILE = "metrics.json"
# A JSON file being written: its name, a random part, this suffix (see _write_json).
PARTIAL_SUFFIX = ".partial"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint number found in a run's folder.

    Attributes:
        index: Its number (``checkpoint_000003``: 3).
        committed: Its marker is there: the upload finished.
        metrics: The metrics reported with it (from the marker; {} when not committed).
    """

    index: int
    committed: bool
    metrics: dict = dataclasses.field(default_factory=dict)


def folder_name(index: int) -> str:
    return f"checkpoint_{index:06d}"


def index_of(path: str | None) -> int | None:
    """The number of the checkpoint at ``path`` (a run's ``checkpoint_000003``), or None."""
    match = _NAME.match((path or "").rstrip("/").rpartition("/")[2])
    return None if match is None or match.group(2) else int(match.group(1))


# ------------------------------------------------------------------------ pure choices


def latest(entries: Iterable[Entry]) -> Entry | None:
    """The committed checkpoint with the highest number: the one to resume from."""
    committed = [entry for entry in entries if entry.committed]
    return max(committed, key=lambda entry: entry.index, default=None)


def next_index(entries: Iterable[Entry]) -> int:
    """The number for the next checkpoint: past every folder there, finished or not."""
    return max((entry.index for entry in entries), default=0) + 1


def ranked(entries: Iterable[Entry], attribute: str | None, order: str) -> list[Entry]:
    """Committed checkpoints best first: by ``attribute`` (``order`` "max" or "min"; ones
    without that metric, or with a value that is not a number, last), else newest first.
    A nested metric is named by its path joined with "/" (``"val/loss"``), as Ray Train
    flattens them."""
    committed = [entry for entry in entries if entry.committed]
    if attribute is None:
        return sorted(committed, key=lambda entry: -entry.index)

    def key(entry: Entry) -> tuple[int, float, int]:
        value = flatten(entry.metrics).get(attribute)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
            return (1, 0.0, -entry.index)
        return (0, -value if order == "max" else value, -entry.index)

    return sorted(committed, key=key)


def to_remove(
    entries: Iterable[Entry],
    num_to_keep: int | None,
    attribute: str | None,
    order: str,
    stale_below: int,
    protected: int | None = None,
) -> list[int]:
    """Which checkpoint numbers to remove after a commit, or once a job has ended.

    Kept: the ``num_to_keep`` best, the latest whatever its score (a restart resumes
    from it, as Ray Train keeps it), and ``protected`` (the one the job started from,
    which its ranks may still read). Removed too: unfinished folders numbered below
    ``stale_below`` (uploads of earlier jobs, cut off when they failed; one numbered
    higher may be an upload still under way).

    Example: numbers 1..4 committed with loss 0.5, 0.2, 0.9, 0.7, num_to_keep 2, "loss"
    by "min": 2 and 1 are the best, 4 is the latest, so 3 goes.
    """
    entries = list(entries)
    removed = [e.index for e in entries if not e.committed and e.index < stale_below]
    if num_to_keep is None:
        return removed
    best = ranked(entries, attribute, order)
    keep = {entry.index for entry in best[:num_to_keep]}
    newest = latest(entries)
    if newest is not None:
        keep.add(newest.index)
    keep.add(protected)
    return removed + sorted(entry.index for entry in best if entry.index not in keep)


# ------------------------------------------------------------------- the filesystem


def _failed(action: str, path: str, err: BaseException) -> CheckpointError:
    return CheckpointError(f"could not {action} {path}: {type(err).__name__}: {err}")


def _listing(storage: RunStorage) -> list[pyarrow.fs.FileInfo]:
    """What the run's folder holds (nothing if it does not exist yet).

    Raises:
        CheckpointError: The storage could not be read.
    """
    import pyarrow.fs

    try:
        selector = pyarrow.fs.FileSelector(storage.run_path, allow_not_found=True)
        return storage.filesystem.get_file_info(selector)
    except storage_errors() as err:
        raise _failed("list the run's folder", storage.run_path, err) from err


def list_entries(
    storage: RunStorage, infos: list[pyarrow.fs.FileInfo] | None = None
) -> list[Entry]:
    """The checkpoints in the run's folder (none if it does not exist yet), from its
    listing ``infos`` when the caller has one.

    Raises:
        CheckpointError: The storage could not be read.
    """
    import pyarrow.fs

    infos = _listing(storage) if infos is None else infos
    folders, markers = set(), set()
    for info in infos:
        match = _NAME.match(info.base_name)
        if match is None:
            continue
        index = int(match.group(1))
        if match.group(2) and info.type == pyarrow.fs.FileType.File:
            markers.add(index)
        elif not match.group(2) and info.type == pyarrow.fs.FileType.Directory:
            folders.add(index)
    entries = []
    for index in sorted(folders | markers):
        marker = read_json(storage, f"{folder_name(index)}.json") if index in markers else None
        committed = isinstance(marker, dict) and isinstance(marker.get("metrics"), dict)
        entries.append(Entry(index, committed, marker["metrics"] if committed else {}))
    return entries


def read_json(storage: RunStorage, name: str) -> Any:
    """The JSON file ``name`` in the run's folder; None when it is missing or is not JSON.

    Raises:
        CheckpointError: The storage could not be read.
    """
    path = f"{storage.run_path}/{name}"
    try:
        with storage.filesystem.open_input_stream(path) as stream:
            text = stream.read()
    except FileNotFoundError:
        return None
    except storage_errors() as err:
        raise _failed("read", path, err) from err
    try:
        return json.loads(text.decode())
    except ValueError:
        return None


def _write_json(storage: RunStorage, name: str, text: bytes) -> None:
    """Writes ``name`` (``text``, JSON) whole or not at all: under a temporary name, then
    moved."""
    path = f"{storage.run_path}/{name}"
    partial = f"{path}.{uuid.uuid4().hex}{PARTIAL_SUFFIX}"
    try:
        with storage.filesystem.open_output_stream(partial) as stream:
            stream.write(text)
        storage.filesystem.move(partial, path)
    except BaseException:
        with contextlib.suppress(Exception):
            storage.filesystem.delete_file(partial)
        raise


def checkpoint_path(storage: RunStorage, index: int) -> str:
    return f"{storage.run_path}/{folder_name(index)}"


def commit(
    storage: RunStorage,
    local_dir: str,
    metrics: dict,
    protected: int | None = None,
    stale_below: int = 1,
    upload_fn: Any = None,
) -> int:
    """Uploads ``local_dir`` as the run's next checkpoint, then writes its marker, then
    removes what the run no longer keeps (see :func:`to_remove`).

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

    Returns:
        The checkpoint's number.

    Raises:
        CheckpointError: A read or write failed; what was there before stays as it was
            (a half-uploaded folder has no marker). Removing what is no longer kept is
            not part of the commit: a failure there is logged.
    """
    import pyarrow.fs

    entries = list_entries(storage)
    index = next_index(entries)
    fs, destination = storage.filesystem, checkpoint_path(storage, index)
    # Encoded before anything is uploaded: metrics that cannot be stored fail here, not
    # after the files, where they would leave a folder without its marker.
    marker = encoded({"index": index, "metrics": metrics, "time": time.time()})
    try:
        if upload_fn is None:
            fs.create_dir(destination, recursive=True)
            pyarrow.fs.copy_files(
                local_dir,
                destination,
                source_filesystem=pyarrow.fs.LocalFileSystem(),
                destination_filesystem=fs,
            )
        else:
            _upload_with(upload_fn, local_dir, destination)
        _write_json(storage, f"{folder_name(index)}.json", marker)
    except storage_errors() as err:
        raise _failed("upload checkpoint to", destination, err) from err
    _remove_unkept(storage, stale_below, protected)
    return index


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


def prune(storage: RunStorage) -> None:
    """Applies the keep policy once a job has ended: its starting checkpoint is no longer
    protected, and an unfinished folder is an upload that was cut off."""
    _remove_unkept(storage, stale_below=None, protected=None)


def _remove_unkept(storage: RunStorage, stale_below: int | None, protected: int | None) -> None:
    """Removes what :func:`to_remove` says (``stale_below`` None: every unfinished
    folder), and the JSON files a killed process left half-written (see
    :func:`stale_partials`). A storage that fails here is logged, not raised: the
    checkpoints that count are already there, and the job's own outcome is what its
    caller needs."""
    try:
        infos = _listing(storage)  # once: a listing is a request to a cloud storage
        entries = list_entries(storage, infos)
        below = next_index(entries) if stale_below is None else stale_below
        for index in to_remove(
            entries,
            storage.num_to_keep,
            storage.score_attribute,
            storage.score_order,
            below,
            protected,
        ):
            remove(storage, index)
        names = [info.base_name for info in infos]
        for name in stale_partials(names, stale_below):
            with contextlib.suppress(FileNotFoundError):
                storage.filesystem.delete_file(f"{storage.run_path}/{name}")
    except Exception as err:  # noqa: BLE001 - any filesystem's error, see above
        logger.warning("the run's old checkpoints were not removed: %s", err)


def stale_partials(names: Iterable[str], stale_below: int | None) -> list[str]:
    """Which of a run folder's ``names`` are JSON files a process left half-written (it
    was killed while writing one: see :func:`_write_json`).

    While a job runs (``stale_below`` its first number), only markers of checkpoints
    numbered below it: any other may be this job's, still being written. Once the job
    has ended (``stale_below`` None), every one.

    Example: with ``stale_below`` 4, ``checkpoint_000002.json.ab12.partial`` goes;
    ``checkpoint_000005.json.cd34.partial`` and ``metrics.json.ef56.partial`` stay.
    """
    stale = []
    for name in names:
        if not name.endswith(PARTIAL_SUFFIX):
            continue
        target = name[: -len(PARTIAL_SUFFIX)].rpartition(".")[0]  # less the random part
        match = _NAME.match(target)
        if target != METRICS_FILE and (match is None or not match.group(2)):
            continue  # not a name _write_json makes: not ours
        if stale_below is None or (match is not None and int(match.group(1)) < stale_below):
            stale.append(name)
    return stale


def write_metrics(storage: RunStorage, metrics: dict) -> None:
    """Records ``metrics`` as the run's last reported ones."""
    try:
        storage.filesystem.create_dir(storage.run_path, recursive=True)
        _write_json(storage, METRICS_FILE, encoded({"metrics": metrics, "time": time.time()}))
    except storage_errors() as err:
        raise _failed("write", f"{storage.run_path}/{METRICS_FILE}", err) from err


def remove(storage: RunStorage, index: int) -> None:
    """Removes checkpoint ``index``: its marker first, so it stops counting at once."""
    fs, path = storage.filesystem, checkpoint_path(storage, index)
    try:
        fs.delete_file(f"{path}.json")
    except FileNotFoundError:
        pass
    except storage_errors() as err:
        raise _failed("remove", f"{path}.json", err) from err
    try:
        fs.delete_dir(path)
    except FileNotFoundError:
        pass
    except storage_errors() as err:
        raise _failed("remove", path, err) from err


# --------------------------------------------------------------------- reading back


def job_env(storage: RunStorage) -> dict[str, str]:
    """The ranks' environment for a job starting now: the storage, and the latest
    committed checkpoint in it, which ``get_checkpoint()`` returns on every rank.

    Raises:
        CheckpointError: The run's folder could not be read.
    """
    entries = list_entries(storage)
    newest = latest(entries)
    if newest is None:
        logger.info("checkpoints go to %s (none there yet)", storage.run_path)
        return storage.to_env(None, next_index(entries))
    path = checkpoint_path(storage, newest.index)
    logger.info("checkpoints go to %s; the job resumes from %s", storage.run_path, path)
    return storage.to_env(path, next_index(entries))


def as_checkpoint(storage: RunStorage, index: int) -> Any:
    """Checkpoint ``index`` as a ``ray.train.Checkpoint`` on the run's filesystem."""
    from ray.train import Checkpoint  # here: ray.train takes seconds to import

    return Checkpoint(checkpoint_path(storage, index), filesystem=storage.filesystem)
