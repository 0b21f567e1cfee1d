"""How a checkpoint's folder travels between a trial's actor and its ranks: as a tar
archive, links followed.

The trial's restored checkpoint goes to the ranks as bytes, once per job
(:func:`pack_checkpoint`). Rank 0's reported checkpoints, many and fast, go as a file on
rank 0's node (:class:`Parcel`): the report carries only its address, and the trial's
actor reads it (there, or through a task on that node) while rank 0 waits for Tune to
take the report, then rank 0 removes it. Sent as bytes through rank 0's log channel,
each checkpoint passed through rank 0's heap and Ray's object store, and rank 0 grew by
about 20 checkpoints' worth before its memory stopped growing.
"""

from __future__ import annotations

import dataclasses
import io
import os
import tarfile
import tempfile
from typing import IO, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.checkpoints import leftovers
from horovod_ray.errors import CheckpointError

# A parcel's file: this prefix, the process id, ``-`` and a suffix.
PARCEL_PREFIX = "horovod_ray-parcel-"


@dataclasses.dataclass(frozen=True)
class Parcel:
    """A checkpoint packed into a file on a node, on its way to the trial's actor."""

    node_id: str
    path: str


def pack_checkpoint(checkpoint: Any) -> bytes | None:
    """A ``ray.tune.Checkpoint``'s folder as a tar archive in memory; None for None.

    Raises:
        CheckpointError: See :func:`_write`.
    """
    if checkpoint is None:
        return None
    buffer = io.BytesIO()
    with checkpoint.as_directory() as directory:
        _write(directory, buffer)
    return buffer.getvalue()


def pack_to_file(checkpoint: Any) -> Parcel | None:
    """A ``ray.tune.Checkpoint``'s folder as a tar archive in a file of this node's
    temporary folder, written as it is read (nothing held in memory); None for None. The
    caller removes it (:func:`remove`).

    Raises:
        CheckpointError: See :func:`_write`.
    """
    if checkpoint is None:
        return None
    descriptor, path = tempfile.mkstemp(prefix=leftovers.owned(PARCEL_PREFIX), suffix=".tar")
    try:
        with os.fdopen(descriptor, "wb") as archive, checkpoint.as_directory() as directory:
            _write(directory, archive)
    except BaseException:
        remove(Parcel("", path))
        raise
    return Parcel(ray.get_runtime_context().get_node_id(), path)


def remove(parcel: Parcel | None) -> None:
    if parcel is not None:
        try:
            os.remove(parcel.path)
        except FileNotFoundError:
            pass


def unpack(data: bytes, directory: str) -> str:
    """Unpacks :func:`pack_checkpoint`'s bytes into ``directory``; returns it."""
    _extract(io.BytesIO(data), directory)
    return directory


def unpack_parcel(parcel: Parcel, directory: str) -> str:
    """Unpacks a parcel into ``directory`` (on this node, read from its file as it is
    extracted; on another, through a task there); returns it."""
    if parcel.node_id == ray.get_runtime_context().get_node_id():
        with open(parcel.path, "rb") as archive:
            _extract(archive, directory)
        return directory
    strategy = NodeAffinitySchedulingStrategy(parcel.node_id, soft=False)
    data = ray.get(_read_on_node.options(scheduling_strategy=strategy).remote(parcel.path))
    return unpack(data, directory)


def _read(path: str) -> bytes:
    with open(path, "rb") as archive:
        return archive.read()


_read_on_node = ray.remote(num_cpus=0, max_retries=0)(_read)


def _extract(archive: IO[bytes], directory: str) -> None:
    with tarfile.open(fileobj=archive, mode="r") as opened:
        opened.extractall(directory, filter="data")


def _write(directory: str, target: IO[bytes]) -> None:
    """The folder as a tar archive into ``target``; links are followed, as the storage
    path's copy (shutil.copytree) does: a link out of the folder (Hugging Face's cache
    lays its files out so) could not be unpacked safely, and its target is part of the
    checkpoint.

    Raises:
        CheckpointError: The folder, or a file a link in it points to, cannot be read; or
            a link in it points to a folder it is in (it would never end).
    """
    try:
        with tarfile.open(fileobj=target, mode="w", dereference=True) as archive:
            _add_tree(archive, directory, ".", frozenset())
    except FileNotFoundError as err:
        raise CheckpointError(
            f"cannot read checkpoint folder {directory} to pass it on: {err} (is it a link "
            f"that points nowhere?)"
        ) from err
    except OSError as err:
        raise CheckpointError(
            f"cannot read checkpoint folder {directory} to pass it on: {err}"
        ) from err


def _add_tree(archive: tarfile.TarFile, path: str, name: str, outer: frozenset[str]) -> None:
    """Adds the folder ``path`` as ``name``, following links; ``outer``: the real paths
    of the folders it is in."""
    real = os.path.realpath(path)
    if real in outer:
        raise CheckpointError(
            f"cannot pass the checkpoint on: {path} is a link to a folder it is in ({real}), "
            f"which would be copied without end; remove the link"
        )
    archive.add(path, arcname=name, recursive=False)
    for entry in sorted(os.listdir(path)):
        inner = os.path.join(path, entry)
        if os.path.isdir(inner):  # a folder, or a link to one
            _add_tree(archive, inner, f"{name}/{entry}", outer | {real})
        else:
            archive.add(inner, arcname=f"{name}/{entry}", recursive=False)
