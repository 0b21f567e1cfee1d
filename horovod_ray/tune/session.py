"""A trial's ranks as Tune sees them: both halves of ``ray.tune.report`` /
``get_checkpoint`` on a Horovod job.

On every rank, Tune's functions are served by a small per-process session
(:class:`RankSession`): rank 0's reports (metrics, and the checkpoint directory packed
into bytes) go to the trial's actor, whose :func:`forward` reports them to Tune; other
ranks' reports are accepted and dropped. The restored checkpoint is unpacked on every
rank.

Checkpoints travel through Ray's object store, so they suit model states of up to a few
hundred MB.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import os
import shutil
import tarfile
import tempfile
from types import ModuleType
from typing import Any, Callable

import ray
from ray import tune

from horovod_ray.checkpoints import upload
from horovod_ray.errors import HorovodRayError
from horovod_ray.rank import report
from horovod_ray.rank.logs import post

# The Ray whose internals this adapter uses (constraints.txt pins it).
_SUPPORTED_RAY = "2.60"


def _ray_internals() -> tuple[ModuleType, Callable[..., Any]]:
    """The two Ray internals this adapter needs, checked once, at import.

    ``ray.train._internal.session._session`` is the process-wide session that
    ``ray.tune.report`` and ``ray.tune.get_checkpoint`` read (the ranks install their own
    there), and ``ray.tune.trainable.function_trainable.wrap_function(fn, name=...)`` makes
    the trainable class. Neither is public API: a Ray that moved them would otherwise fail
    with an ImportError deep in Ray, or send the ranks' reports nowhere.

    Raises:
        HorovodRayError: Naming the Ray found, the one supported and what is missing.
    """

    def unsupported(missing: str) -> HorovodRayError:
        return HorovodRayError(
            f"horovod_ray.tune supports Ray {_SUPPORTED_RAY} and found Ray {ray.__version__}, "
            f"which lacks {missing}; install ray[tune]=={_SUPPORTED_RAY}.0 (see constraints.txt)"
        )

    try:
        from ray.train._internal import session
    except ImportError as err:
        raise unsupported("ray.train._internal.session") from err
    try:
        from ray.tune.trainable.function_trainable import wrap_function
    except ImportError as err:
        raise unsupported("ray.tune.trainable.function_trainable.wrap_function") from err
    if not hasattr(session, "_session"):
        raise unsupported("ray.train._internal.session._session")
    if "name" not in inspect.signature(wrap_function).parameters:
        raise unsupported("the name parameter of wrap_function")
    return session, wrap_function


train_session, wrap_function = _ray_internals()


# The folders checkpoint copies are made in, followed by the process id and a suffix.
RESTORED_PREFIX = "horovod_ray-restored-"
FORWARDED_PREFIX = "horovod_ray-checkpoint-"


@dataclasses.dataclass(frozen=True)
class Report:
    """One ``ray.tune.report`` from rank 0, on its way to the trial's actor."""

    metrics: dict
    checkpoint: bytes | None


def _pack(directory: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        archive.add(directory, arcname=".")
    return buffer.getvalue()


def _unpack(data: bytes, directory: str) -> str:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as archive:
        archive.extractall(directory, filter="data")
    return directory


def pack_checkpoint(checkpoint: tune.Checkpoint | None) -> bytes | None:
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        return _pack(directory)


class RankSession:
    """What ``ray.tune.report`` / ``get_checkpoint`` find on a rank of a trial's job.

    Ray's Tune functions look up a process-wide session object; on the trial's actor that
    is Tune's own, on the ranks it is this one.
    """

    # Tune's functions read world_rank None as "a Tune session, not a Train one".
    world_rank = None

    def __init__(self, rank: int, checkpoint: bytes | None, trial_info: dict) -> None:
        self._rank = rank
        self._checkpoint_bytes = checkpoint
        self._checkpoint_dir: str | None = None
        self.trial_name = trial_info.get("trial_name")
        self.trial_id = trial_info.get("trial_id")
        self.trial_resources = trial_info.get("trial_resources")
        self.experiment_name = trial_info.get("experiment_name")

    @property
    def loaded_checkpoint(self) -> tune.Checkpoint | None:
        if self._checkpoint_bytes is None:
            return None
        if self._checkpoint_dir is None:
            directory = tempfile.mkdtemp(prefix=f"{RESTORED_PREFIX}{os.getpid()}-")
            self._checkpoint_dir = _unpack(self._checkpoint_bytes, directory)
        return tune.Checkpoint.from_directory(self._checkpoint_dir)

    def report(self, metrics: dict, *, checkpoint: tune.Checkpoint | None = None) -> None:
        if self._rank != 0:
            return
        # Packed now: the caller may delete the directory as soon as report returns.
        post(Report(dict(metrics), pack_checkpoint(checkpoint)))

    def close(self) -> None:
        if self._checkpoint_dir is not None:
            shutil.rmtree(self._checkpoint_dir, ignore_errors=True)


def install_session(session: RankSession | None) -> None:
    """Makes ``session`` the process-wide session Tune's functions read.

    ``ray.tune.report`` and ``ray.tune.get_checkpoint`` look up
    ``ray.train._internal.session._session`` (Ray 2.60); ``_ray_internals`` checked at
    import that it is there, and test_tune checks that Tune reads it.
    """
    train_session._session = session


def sweep_stale(root: str | None = None) -> list[str]:
    """Removes the checkpoint copies (restored on a rank, or on their way to Tune) that a
    process left when it was killed: a stopped trial's ranks are killed with no grace, so
    the ``finally`` that removes their copy never runs, and Population Based Training
    restores again and again. A copy's folder names its process; a process that is gone
    leaves a copy nobody reads. Returns the folders removed.

    Args:
        root: Where the copies are made (the temporary folder by default).
    """
    return upload.sweep_stale((RESTORED_PREFIX, FORWARDED_PREFIX), root)


def rank_main(func: Callable[[dict], Any], config: dict, checkpoint, trial_info: dict) -> None:
    sweep_stale()
    session = RankSession(int(os.environ["HOROVOD_RANK"]), checkpoint, trial_info)
    install_session(session)
    report.use_tune_session(session)  # horovod_ray.report / get_checkpoint go to Tune too
    try:
        func(config)
    finally:
        report.use_tune_session(None)
        install_session(None)
        session.close()


def forward(item: object) -> None:
    """Runs on the trial's actor: hands one of rank 0's reports to Tune."""
    if not isinstance(item, Report):
        return  # horovod_ray.log() dicts have no meaning to Tune
    if item.checkpoint is None:
        tune.report(item.metrics)
        return
    directory = tempfile.mkdtemp(prefix=f"{FORWARDED_PREFIX}{os.getpid()}-")
    try:
        _unpack(item.checkpoint, directory)
        # Tune persists the checkpoint to the trial's storage before report returns.
        tune.report(item.metrics, checkpoint=tune.Checkpoint.from_directory(directory))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
