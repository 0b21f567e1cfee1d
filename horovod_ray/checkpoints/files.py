"""Reading and writing a run's folder on its pyarrow filesystem: what the filesystem
raises, the listing, and JSON files written whole or not at all (see ``store`` for what
the folder holds)."""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import TYPE_CHECKING, Any

from horovod_ray.checkpoints.choices import PARTIAL_SUFFIX
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import CheckpointError

if TYPE_CHECKING:
    import pyarrow.fs


def storage_errors() -> tuple[type[BaseException], ...]:
    """What a pyarrow filesystem raises when it fails (pyarrow is imported only when a
    storage is used: it adds a quarter of a second to every rank's start)."""
    import pyarrow

    return (OSError, pyarrow.ArrowException)


def failed(action: str, path: str, err: BaseException) -> CheckpointError:
    return CheckpointError(f"could not {action} {path}: {type(err).__name__}: {err}")


def listing(storage: RunStorage) -> list[pyarrow.fs.FileInfo]:
    """What the run's folder holds (nothing if it does not exist yet).

    Raises:
        CheckpointError: The storage could not be read.
    """
    import pyarrow.fs

    selector = pyarrow.fs.FileSelector(storage.run_path, allow_not_found=True)
    try:
        try:
            return storage.filesystem.get_file_info(selector)
        except FileNotFoundError:
            # Made while it was listed (rank 0's NO_UPLOAD folder, a first commit): the
            # listing failed, then found it there. It is there now.
            return storage.filesystem.get_file_info(selector)
    except storage_errors() as err:
        raise failed("list the run's folder", storage.run_path, err) from err


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
        raise failed("read", path, err) from err
    try:
        return json.loads(text.decode())
    except ValueError:
        return None


def write_json(storage: RunStorage, name: str, text: bytes) -> None:
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
