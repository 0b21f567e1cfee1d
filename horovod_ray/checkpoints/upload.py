"""Rank 0's checkpoints, persisted beside training.

``report(metrics, checkpoint=...)`` copies the checkpoint's files to a local staging
folder (the caller may delete its own folder as soon as report returns) and hands them
to one upload thread, which commits them in order (see ``store.commit``). Training goes on
meanwhile; it waits only when ``PENDING`` checkpoints already wait to be uploaded, so a
storage slower than the checkpoints it is given slows training down rather than filling
the disk. A failed upload is raised, as a :class:`CheckpointError`, from the next
``report`` or from :meth:`Uploader.flush`, which the rank runs when the user's function
returns. A job that fails while an upload runs cuts it off: that checkpoint was never
committed, and the restarted job resumes from the one before.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
from typing import Any

from horovod_ray.checkpoints import store
from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.errors import CheckpointError

logger = logging.getLogger(__name__)

# Checkpoints that may wait for the upload thread before report() waits too.
PENDING = 2
STAGING_PREFIX = "horovod_ray-upload-"
_METRICS = object()  # a queue item: write the latest metrics-only report


class Uploader:
    """One process's upload thread for one run's storage."""

    def __init__(self, storage: RunStorage) -> None:
        self.storage = storage
        self._queue: queue.Queue = queue.Queue(maxsize=PENDING)
        self._lock = threading.Lock()
        self._error: CheckpointError | None = None
        self._next_index: int | None = None
        self._metrics: dict | None = None  # a metrics-only report waiting to be written
        self._thread = threading.Thread(
            target=self._work, name="horovod_ray-checkpoint-upload", daemon=True
        )
        self._thread.start()

    def submit(self, metrics: dict, checkpoint: Any) -> int:
        """Stages ``checkpoint`` (a ``ray.train.Checkpoint``) and queues its upload.

        Returns:
            The number it will be committed under.

        Raises:
            CheckpointError: An earlier upload failed, or the storage cannot be listed.
        """
        self.raise_failure()
        if self._next_index is None:
            # Once per process: past everything there, so a restarted job or a new driver
            # never writes over an earlier checkpoint.
            self._next_index = store.next_index(store.list_entries(self.storage))
        index = self._next_index
        self._next_index += 1
        staging = tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-")
        try:
            with checkpoint.as_directory() as directory:
                shutil.copytree(directory, staging, dirs_exist_ok=True)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._queue.put((index, staging, metrics))
        return index

    def submit_metrics(self, metrics: dict) -> None:
        """Queues ``metrics`` as the run's last ones; a newer call replaces a waiting one."""
        self.raise_failure()
        with self._lock:
            waiting = self._metrics is not None
            self._metrics = metrics
        if not waiting:
            self._queue.put(_METRICS)

    def flush(self) -> None:
        """Waits until every queued upload is done.

        Raises:
            CheckpointError: One of them failed.
        """
        self._queue.join()
        self.raise_failure()

    def raise_failure(self) -> None:
        error = self._error
        if error is not None:
            raise CheckpointError(str(error)) from error

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _METRICS:
                    with self._lock:
                        metrics, self._metrics = self._metrics, None
                    if self._error is None:
                        store.write_metrics(self.storage, metrics)
                    continue
                index, staging, metrics = item
                try:
                    if self._error is None:  # after one failure, nothing more is committed
                        store.commit(self.storage, index, staging, metrics)
                        logger.debug("checkpoint %d committed", index)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
            except CheckpointError as err:
                self._error = err
            except Exception as err:  # noqa: BLE001 - kept for the training thread
                self._error = CheckpointError(f"checkpoint upload failed: {err!r}")
            finally:
                self._queue.task_done()
