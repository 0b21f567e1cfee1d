"""``report()`` and ``get_checkpoint()``: Ray Train's two calls, on a Horovod rank.

One training function runs unchanged under ``run()``, ``RayExecutor``, the command
line's ``python`` commands and Tune:

* Under Tune (a trial of ``horovod_ray.tune``), both calls go to the trial's session:
  Tune persists the checkpoint and hands it back on a restore.
* Elsewhere, with a storage path (``run(storage_path=...)``, ``create_settings``,
  ``--storage-path``), rank 0's checkpoints are persisted to ``storage_path/name`` by an
  upload thread (``checkpoints.upload``), and ``get_checkpoint()`` is the latest one
  committed when the job started, on every rank.
* Without one, ``report`` hands its metrics to the driver's callbacks and keeps no
  checkpoint (a warning says so once); ``get_checkpoint()`` is None.

Only rank 0's reports count. Other ranks may call ``report`` (the same code runs on
every rank) and their metrics and checkpoints are dropped: a checkpoint holds what rank
0 holds, which with Horovod's synchronised training is every rank's model.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from typing import Any, Mapping

from horovod_ray.checkpoints import store
from horovod_ray.checkpoints import validation as validations
from horovod_ray.checkpoints.choices import PENDING_VALIDATION
from horovod_ray.checkpoints.metrics import checked_metrics, plain
from horovod_ray.checkpoints.spec import CHECKPOINT_ENV, FIRST_INDEX_ENV, RunStorage
from horovod_ray.checkpoints.upload import Uploader
from horovod_ray.errors import ConfigError
from horovod_ray.rank import dropped, logs, preemption, session
from horovod_ray.rank import metrics as rank_metrics
from horovod_ray.rank import report_options as options

logger = logging.getLogger(__name__)


def report(
    metrics: Mapping[str, Any],
    checkpoint: Any = None,
    checkpoint_dir_name: str | None = None,
    checkpoint_upload_mode: Any = None,
    delete_local_checkpoint_after_upload: bool | None = None,
    checkpoint_upload_fn: Any = None,
    validation: Any = False,
) -> None:
    """Reports metrics, and optionally a checkpoint, from a rank (as ``ray.train.report``).

    Rank 0's metrics go to the driver's callbacks (as ``log()``'s) and, with a storage
    path, become the run's last metrics; its checkpoint is copied at once (the folder may
    be deleted when this returns) and uploaded to ``storage_path/name`` beside training.
    Other ranks' reports are dropped. The parameters are ``ray.train.report``'s (Ray
    2.60); those this package does not honour yet are refused when given.

    Args:
        metrics: Values keyed by name (str), e.g. ``{"epoch": 3, "loss": 0.2}``, or
            nested (``{"val": {"loss": 0.2}}``, scored as ``"val/loss"``); stored as JSON
            (values that are not JSON are stored as their ``repr``).
        checkpoint: A ``ray.train.Checkpoint``, e.g.
            ``Checkpoint.from_directory(folder)``.
        checkpoint_dir_name: The checkpoint's folder in the run's (``storage_path/name``),
            e.g. ``f"epoch_{epoch}"``; None: ``checkpoint_`` and its number
            (``checkpoint_000003``). Either way checkpoints count in the order they are
            committed. A name another checkpoint of the run has, or another folder
            there, fails the upload (``CheckpointError``, raised by the next call); a
            path, a hidden name or one the run's folder keeps for itself
            (``checkpoint_`` and 6 or more digits, ``*.json``, ``*.partial``) is a
            ``ConfigError`` here.
        checkpoint_upload_mode: None (the default) returns once the checkpoint is copied
            locally and uploads it beside training; ``CheckpointUploadMode.SYNC`` returns
            once it is committed; ``ASYNC`` is the default's behaviour; ``NO_UPLOAD``:
            the checkpoint is a folder the function wrote in the run's folder itself,
            not deeper (``get_context().get_storage()``: its ``filesystem`` and
            ``run_path``), and is committed where it is, after the uploads before it:
            keep the folder until then. ``checkpoint_dir_name``, if given, must be its
            name. The keep policy removes it as any other.
        delete_local_checkpoint_after_upload: The checkpoint's folder (on this node) is
            deleted once it is committed: on rank 0 by the upload thread (with ``SYNC``,
            before ``report`` returns), on another rank, whose checkpoint is dropped, at
            once. None: Ray's default for the mode, True for ``ASYNC``, else False. A
            folder in the run's storage (a checkpoint read back) is refused.
        checkpoint_upload_fn: ``fn(checkpoint, destination)`` uploads the checkpoint
            itself (on rank 0's upload thread, from its copy), to ``destination``, the
            full path of the checkpoint's folder (numbered, or ``checkpoint_dir_name``)
            on the storage's filesystem (not yet there; Ray passes a folder name
            instead), and returns it as a
            ``Checkpoint``; the commit marker is written after it. Its returned
            checkpoint must be at ``destination``.
        Under Tune, the checkpoint goes to Tune's own report: ``checkpoint_dir_name``,
        ``checkpoint_upload_mode``, ``delete_local_checkpoint_after_upload`` and
        ``checkpoint_upload_fn`` are refused there, as is ``validation``.
        validation: True: once the checkpoint is committed, the run's
            ``ValidationConfig.fn`` validates it in a Ray task and the metrics it returns
            are merged into the checkpoint's (``ray.train.ValidationTaskConfig``: with
            its ``fn_kwargs`` over the run's, and its ``timeout_s``); see
            ``checkpoints.validation``. Needs a checkpoint and the run's
            ``validation_config`` (``run()``, ``create_settings``). Refused under Tune.

    Raises:
        ConfigError: ``metrics`` is not a mapping with str keys, ``checkpoint`` not a
            Checkpoint, or a parameter that is refused, named.
        CheckpointError: An earlier upload failed, or the storage cannot be read.
    """
    metrics = checked_metrics(metrics)
    if checkpoint is not None and not hasattr(checkpoint, "as_directory"):
        raise ConfigError(
            "checkpoint",
            f"checkpoint must be a ray.train.Checkpoint (Checkpoint.from_directory(folder)), "
            f"got {type(checkpoint).__name__}",
        )
    sync, delete_local, in_place = options.upload_options(
        checkpoint_dir_name,
        checkpoint_upload_mode,
        delete_local_checkpoint_after_upload,
        checkpoint_upload_fn,
    )
    rank_metrics.reported(metrics)
    tune = session.current().tune
    if tune is not None:
        options.refuse_under_tune(checkpoint_dir_name, checkpoint_upload_mode,
                           delete_local_checkpoint_after_upload, checkpoint_upload_fn,
                           validation)  # fmt: skip
        tune.report(metrics, checkpoint=checkpoint)
        return
    request = validations.task_request(
        validation, checkpoint is not None, os.environ.get(validations.VALIDATION_ENV) == "1"
    )
    if not session.current().local and logs.rank_now() != 0:
        dropped.drop(checkpoint if delete_local else None)
        return
    uploader = _rank_uploader()
    if uploader is not None:
        plain(metrics)  # metrics that cannot be stored are refused before a callback sees them
    logs.post(metrics)
    if uploader is None:
        if checkpoint is not None:
            _warn_once()
        return
    if checkpoint is None:
        uploader.submit_metrics(metrics)
    else:
        if delete_local:
            options.outside_the_run(checkpoint, uploader.storage)
        if in_place:
            checkpoint_dir_name = options.folder_in_the_run(checkpoint, uploader.storage,
                                                     checkpoint_dir_name)  # fmt: skip
        # A checkpoint reported on a static job's preemption notice: this process is
        # stopped before the caller could remove its folder, so it goes once committed,
        # unless the caller said to keep it.
        just_in_time = preemption.stops_after_checkpoint()
        if (
            just_in_time
            and delete_local_checkpoint_after_upload is None
            and not in_place
            and not options.in_the_run(checkpoint, uploader.storage)
        ):
            delete_local = True
        # The upload thread deletes the folder once the checkpoint is committed.
        uploader.submit(
            metrics,
            checkpoint,
            checkpoint_upload_fn,
            delete_local and options.on_this_node(checkpoint),
            checkpoint_dir_name,
            in_place,
            request,
        )
        if sync or just_in_time:
            uploader.flush()
        if just_in_time:
            preemption.saved_then_wait()  # the job stops now, to resume from it


def get_all_reported_checkpoints(consistency_mode: Any = None, timeout_s: float | None = None):
    """The checkpoints this run has committed so far, oldest first, each with its
    metrics (as ``ray.train.get_all_reported_checkpoints``). On rank 0, first waits for
    the uploads of its reports so far; another rank reads what is committed now. With
    VALIDATED, then waits until no committed checkpoint's validation is under way (in a
    run with a ``validation_config``).

    Args:
        consistency_mode: Ray's ``CheckpointConsistencyMode``: COMMITTED, or VALIDATED
            (the default).
        timeout_s: The longest wait, for both; None: as long as they take. Past it, the
            checkpoints as they are then.

    Returns:
        ``ray.train``'s ``ReportedCheckpoint`` records (``checkpoint``, ``metrics``,
        ``status``: COMMITTED without a validation, else PENDING_VALIDATION,
        VALIDATED, VALIDATION_FAILED or VALIDATION_TIMEOUT); [] without a storage path.
        The keep policy may have removed older ones.

    Raises:
        CheckpointError: An upload failed, or the storage cannot be read.
        HorovodRayError: Under Tune (ask Tune for the trial's checkpoints).
    """
    from horovod_ray.errors import HorovodRayError

    mode = getattr(consistency_mode, "value", consistency_mode)
    if mode not in (None, "COMMITTED", "VALIDATED"):
        raise ConfigError(
            "consistency_mode",
            f"consistency_mode must be CheckpointConsistencyMode.COMMITTED or VALIDATED, got "
            f"{consistency_mode!r}",
        )
    if session.current().tune is not None:
        raise HorovodRayError(
            "get_all_reported_checkpoints() is not available in a Tune trial: Tune keeps "
            "the trial's checkpoints (tune.Tuner's results)"
        )
    storage = RunStorage.from_env()
    if storage is None:
        return []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    uploader = session.current().uploader
    if uploader is not None:
        uploader.finish_submitted(timeout_s)  # None: as long as they take
        uploader.raise_failure()
    from ray.train.v2.api.reported_checkpoint import (
        ReportedCheckpoint,
        ReportedCheckpointStatus,
    )

    entries = [entry for entry in store.list_entries(storage) if entry.committed]
    if mode != "COMMITTED" and os.environ.get(validations.VALIDATION_ENV) == "1":
        began = warned = time.monotonic()
        while any(entry.status == PENDING_VALIDATION for entry in entries) and (
            deadline is None or time.monotonic() < deadline
        ):
            time.sleep(validations.POLL_S)
            entries = [entry for entry in store.list_entries(storage) if entry.committed]
            if time.monotonic() - warned >= validations.WARN_S:
                warned = time.monotonic()
                logger.warning(
                    "get_all_reported_checkpoints() has waited %.0fs for validations (a "
                    "validation's Ray task may wait for a CPU the ranks hold: see "
                    "ValidationConfig's ray_remote_kwargs, or pass consistency_mode="
                    "COMMITTED or timeout_s)",
                    warned - began,
                )
    return [
        ReportedCheckpoint(
            store.as_checkpoint(storage, entry),
            entry.metrics,
            ReportedCheckpointStatus(entry.status),
        )
        for entry in entries
    ]


def get_checkpoint() -> Any:
    """The checkpoint to resume from (as ``ray.train.get_checkpoint``), or None.

    With a storage path: the latest checkpoint committed in ``storage_path/name`` when
    this job started (a restart's job, or a new driver's with the same name), the same on
    every rank; the checkpoints this job reports do not change it. Under Tune: the
    trial's restored checkpoint. Otherwise None.

    Returns:
        A ``ray.train.Checkpoint`` (read it with ``as_directory()`` or
        ``to_directory()``), or None.
    """
    tune = session.current().tune
    if tune is not None:
        return tune.loaded_checkpoint
    path = os.environ.get(CHECKPOINT_ENV)
    storage = RunStorage.from_env()
    if not path or storage is None:
        return None
    from ray.train import Checkpoint  # here: ray.train takes seconds to import

    return Checkpoint(path, filesystem=storage.filesystem)


def flush() -> None:
    """Waits until this process's checkpoints are uploaded (run as a call returns).

    Raises:
        CheckpointError: An upload failed.
    """
    uploader = session.current().uploader
    if uploader is not None:
        uploader.flush()


def finish_submitted(timeout_s: float) -> bool:
    """Waits up to ``timeout_s`` for the checkpoints reported so far to be uploaded (not
    for later ones); whether they are (see ``Uploader.finish_submitted``)."""
    uploader = session.current().uploader
    return uploader is None or uploader.finish_submitted(timeout_s)


def close_uploader() -> None:
    """Ends this session's upload thread (a local run's, once it was flushed): the next
    job's storage may be another."""
    now = session.current()
    if now.uploader is not None:
        now.uploader.close()
        now.uploader = None


def tune_session() -> Any:
    """The Tune trial's session this rank's reports go to, or None."""
    return session.current().tune


def use_tune_session(trial: Any) -> None:
    """Sends this rank's reports to a Tune trial's session (None: stop doing so)."""
    session.current().tune = trial


def _rank_uploader() -> Uploader | None:
    now = session.current()
    if now.uploader is None:
        storage = RunStorage.from_env()
        if storage is None:
            return None
        now.uploader = Uploader(
            storage,
            protected=store.index_at(storage, os.environ.get(CHECKPOINT_ENV)),
            stale_below=int(os.environ.get(FIRST_INDEX_ENV) or 1),
            watch=rank_metrics,
        )
        # A process that is not an actor (a command line's python command) has no call
        # to end: its uploads finish as it exits.
        atexit.register(_flush_at_exit)
    return now.uploader


def _flush_at_exit() -> None:
    """Waits for the uploads; one that failed and was never raised fails the process
    (a command line's command: its job then fails as for any rank's failure)."""
    now = session.current()
    if now.in_actor:
        return  # an actor's uploads ended with its calls, or were cut off with the job
    failure = now.uploader.unraised_failure() if now.uploader is not None else None
    if failure is not None:
        logger.error("a checkpoint was not persisted: %s", failure)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # an exit handler cannot raise; the exit status must say it


def _warn_once() -> None:
    now = session.current()
    if not now.warned:
        now.warned = True
        logger.warning(
            "report(checkpoint=...) keeps nothing without a storage path: give run(..., "
            "storage_path=...), create_settings(storage_path=...) or --storage-path"
        )
