"""Rank 0's checkpoints, persisted beside training.

``report(metrics, checkpoint=...)`` copies the checkpoint's files to a local staging
folder (the caller may delete its own folder as soon as report returns) and hands them
to one upload thread, which commits them in order (see ``store.commit``). Training goes on
meanwhile; it waits only when ``PENDING`` checkpoints are already staged or uploading, so
a storage slower than the checkpoints it is given slows training down rather than
filling the disk, and a job that fails loses at most that many. A failed upload is
raised, as a :class:`CheckpointError`, from the next ``report`` or from
:meth:`Uploader.flush`, which the rank runs when the user's function returns. A job that
fails while an upload runs cuts it off: that checkpoint was never committed, and the
restarted job resumes from the one before.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Any

from horovod_ray.checkpoints import leftovers, store
from horovod_ray.checkpoints import metrics as metrics_
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import CheckpointError

logger = logging.getLogger(__name__)

# Checkpoints that may be staged or uploading at once before report() waits.
PENDING = 2
# A staging folder's name: this prefix, the process id, a random suffix.
STAGING_PREFIX = "horovod_ray-upload-"
_METRICS = object()  # a queue item: write the latest metrics-only report
_CLOSE = object()  # a queue item: the thread ends


class Uploader:
    """One process's upload thread for one run's storage.

    Args:
        storage: The run's storage.
        protected: A checkpoint number the keep policy must not remove (the one this job
            started from, which its ranks may still be reading).
        stale_below: The first number free when the job started: an unfinished folder
            below it is an earlier job's cut-off upload (see ``choices.to_remove``).
        watch: Told of each upload (``upload_done(seconds, size)``), of the queue
            (``upload_queue(waiting)``) and of failures (``upload_failures(count)``): the
            rank's metrics (``rank.metrics``); None tells no one.
    """

    def __init__(
        self,
        storage: RunStorage,
        protected: int | None = None,
        stale_below: int = 1,
        watch: Any = None,
    ) -> None:
        self.storage = storage
        self._watch = watch or _Unwatched()
        self._protected = protected
        self._stale_below = stale_below
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.BoundedSemaphore(PENDING)
        self._lock = threading.Lock()
        self._error: CheckpointError | None = None
        self._error_raised = False
        # Reports are numbered in the order they were made, so that the run's last
        # metrics are never overwritten by an earlier report's that committed later.
        self._sequence = 0
        self._written = 0
        self._handled = 0  # the newest report the thread is done with (committed or not)
        self._progress = threading.Condition(self._lock)
        self._metrics: tuple[int, dict] | None = None  # a metrics-only report waiting
        self._staged = 0  # checkpoints reported and not yet handled (a metric)
        self._unscored_logged = False
        leftovers.sweep_stale((STAGING_PREFIX,))
        self._watch.upload_failures(0)
        self._watch.upload_queue(0)
        self._thread = threading.Thread(
            target=self._work, name="horovod_ray-checkpoint-upload", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        metrics: dict,
        checkpoint: Any,
        upload_fn: Any = None,
        delete_after: bool = False,
        dir_name: str | None = None,
        in_place: bool = False,
        validation: dict | None = None,
    ) -> None:
        """Stages ``checkpoint`` (a ``ray.train.Checkpoint``) and queues its upload (by
        ``upload_fn(checkpoint, destination)`` when given: see ``report``), into the
        run's folder ``dir_name`` when given; with ``delete_after``, its own folder is
        removed once the checkpoint is committed. ``in_place``: the checkpoint is the
        run's folder ``dir_name`` already (``NO_UPLOAD``): nothing is staged or copied,
        its commit only writes its marker (in turn with the uploads before it).
        ``validation``: the report's validation request, recorded in the marker.

        Raises:
            ConfigError: ``metrics`` cannot be stored.
            CheckpointError: An earlier upload failed.
        """
        self.raise_failure()
        metrics = metrics_.plain(metrics)  # refused here, in the caller's thread, if it must be
        self._check_score(metrics)
        self._slots.acquire()  # released once its upload is done
        staging = None
        try:
            if not in_place:
                staging = tempfile.mkdtemp(prefix=leftovers.owned(STAGING_PREFIX))
                with checkpoint.as_directory() as directory:
                    shutil.copytree(directory, staging, dirs_exist_ok=True)
        except BaseException:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            self._slots.release()
            raise
        with self._lock:
            self._sequence += 1
            sequence = self._sequence
            self._staged += 1
            self._watch.upload_queue(self._staged)
        source = checkpoint.path if delete_after else None
        self._queue.put((sequence, staging, metrics, upload_fn, source, dir_name, validation))

    def submit_metrics(self, metrics: dict) -> None:
        """Queues ``metrics`` as the run's last ones; a newer call replaces a waiting one.

        Raises:
            ConfigError: ``metrics`` cannot be stored.
            CheckpointError: An earlier upload failed.
        """
        self.raise_failure()
        metrics = metrics_.plain(metrics)
        with self._lock:
            waiting = self._metrics is not None
            self._sequence += 1
            self._metrics = (self._sequence, metrics)
        if not waiting:
            self._queue.put(_METRICS)

    def _check_score(self, metrics: dict) -> None:
        """Logs, once, a checkpoint without the metric that ranks checkpoints: it ranks
        below every scored one, so the keep policy removes it before them."""
        attribute = self.storage.score_attribute
        if attribute is None or self._unscored_logged:
            return
        flat = metrics_.flatten(metrics)
        if attribute not in flat:
            self._unscored_logged = True
            logger.error(
                "a checkpoint was reported without %r, the checkpoint_score_attribute "
                "(reported: %s); it ranks below every checkpoint that has it. Report it "
                "with every checkpoint (nested metrics are named by their path, 'val/loss')",
                attribute,
                sorted(flat),
            )

    def flush(self) -> None:
        """Waits until every queued upload is done.

        Raises:
            CheckpointError: One of them failed.
        """
        self._queue.join()
        self.raise_failure()

    def finish_submitted(self, timeout_s: float | None) -> bool:
        """Waits up to ``timeout_s`` for the reports made so far, not for those made while
        it waits (training goes on meanwhile, and may report faster than they upload).

        Returns:
            Whether they are done (one that failed counts as done: nothing is committed
            after it).
        """
        return self.wait_handled(self.submitted(), timeout_s)

    def submitted(self) -> int:
        """The number of the newest report (each report, with or without a checkpoint,
        takes the next)."""
        with self._lock:
            return self._sequence

    def wait_handled(self, sequence: int, timeout_s: float | None) -> bool:
        """Waits up to ``timeout_s`` until the thread is done with report ``sequence`` and
        those before it; whether it is (or an upload failed: nothing is committed after)."""
        with self._progress:
            return self._progress.wait_for(
                lambda: self._handled >= sequence or self._error is not None, timeout_s
            )

    def raise_failure(self) -> None:
        error = self._error
        if error is not None:
            self._error_raised = True
            raise CheckpointError(str(error)) from error

    def unraised_failure(self) -> CheckpointError | None:
        """The failure of an upload that no call has raised yet (at the process's exit)."""
        self._queue.join()
        return None if self._error_raised else self._error

    def close(self) -> None:
        """Ends the upload thread once what was queued is done (a local run's uploader,
        whose process goes on)."""
        self._queue.put(_CLOSE)
        self._thread.join()

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                self._queue.task_done()
                return
            try:
                if item is _METRICS:
                    with self._lock:
                        (sequence, metrics), self._metrics = self._metrics, None
                    self._write_metrics(sequence, metrics)
                    self._handle(sequence)
                    continue
                sequence, staging, metrics, upload_fn, source, dir_name, validation = item
                try:
                    if self._error is None:  # after one failure, nothing more is committed
                        size = 0 if staging is None else _folder_bytes(staging)
                        began = time.perf_counter()
                        index = store.commit(
                            self.storage,
                            staging,
                            metrics,
                            self._protected,
                            self._stale_below,
                            upload_fn,
                            dir_name,
                            validation,
                        )
                        self._watch.upload_done(time.perf_counter() - began, size)
                        if source is not None:  # report(delete_local_...=True): committed
                            shutil.rmtree(source, ignore_errors=True)
                        logger.debug("checkpoint %d committed", index)
                        self._write_metrics(sequence, metrics)
                finally:
                    if staging is not None:
                        shutil.rmtree(staging, ignore_errors=True)
                    self._slots.release()
                    with self._lock:
                        self._staged -= 1
                        self._watch.upload_queue(self._staged)
                    self._handle(sequence)
            except CheckpointError as err:
                self._fail(err)
            except Exception as err:  # noqa: BLE001 - kept for the training thread
                self._fail(CheckpointError(f"checkpoint upload failed: {err!r}"))
            finally:
                self._queue.task_done()

    def _handle(self, sequence: int) -> None:
        with self._progress:
            self._handled = max(self._handled, sequence)
            self._progress.notify_all()

    def _fail(self, error: CheckpointError) -> None:
        self._watch.upload_failures(1)
        with self._progress:
            self._error = error
            self._progress.notify_all()

    def _write_metrics(self, sequence: int, metrics: dict) -> None:
        if self._error is None and sequence > self._written:
            store.write_metrics(self.storage, metrics)
            self._written = sequence


class _Unwatched:
    """An uploader's watch that tells no one."""

    def upload_done(self, seconds: float, size: int) -> None:
        pass

    def upload_queue(self, waiting: int) -> None:
        pass

    def upload_failures(self, failures: int) -> None:
        pass


def _folder_bytes(folder: str) -> int:
    """The size of the files under ``folder`` (for the metrics: what it cannot read counts
    0, never failing the upload)."""
    size = 0
    for root, _, names in os.walk(folder):
        for name in names:
            try:
                size += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return size
