"""What a job does with its run's folder around its ranks' life, the same for a
``RayExecutor``'s job and a local run's: before the ranks start, the folder is read
(the checkpoint to resume from, the first free number) and the ranks' environment made;
while they run, the run's validations are run (``validator``); once they have stopped,
the validations are waited for (or left pending, after a failure), then the keep policy
removes what it no longer keeps."""

from __future__ import annotations

import logging

from horovod_ray.checkpoints import store
from horovod_ray.checkpoints.choices import Entry, latest, next_index
from horovod_ray.checkpoints.files import storage_errors
from horovod_ray.checkpoints.spec import FIRST_INDEX_ENV, RunStorage
from horovod_ray.checkpoints.validation import VALIDATION_ENV, Validation
from horovod_ray.checkpoints.validator import Validator

logger = logging.getLogger(__name__)


class JobCheckpoints:
    """A job's side of its run's folder (see the module).

    Args:
        storage: The run's storage.
        validation: The run's ``validation_config``, checked; None: none.
        in_process: Validations run in threads of this process (``run(local=True)``),
            not as Ray tasks.
    """

    def __init__(
        self, storage: RunStorage, validation: Validation | None, in_process: bool = False
    ) -> None:
        self.storage = storage
        self._validator = None if validation is None else Validator(storage, validation, in_process)
        self._first_index: int | None = None  # the job's first number, once its env is made

    def rank_env(self) -> dict[str, str]:
        """The ranks' environment (see :func:`job_env`), and whether their
        ``report(validation=...)`` is taken.

        Raises:
            CheckpointError: The run's folder could not be read.
        """
        env = job_env(self.storage)
        self._first_index = int(env[FIRST_INDEX_ENV])
        if self._validator is not None:
            env[VALIDATION_ENV] = "1"
        return env

    def start(self) -> None:
        """Starts running the validations the ranks ask for (and earlier jobs left)."""
        if self._validator is not None:
            self._validator.start()

    def end(self, finished: bool) -> None:
        """Once the ranks have stopped: waits for every validation asked for when the job
        ``finished`` (else cancels the one under way: they stay pending for the next job),
        then applies the keep policy, even when Ctrl-C ends the wait."""
        try:
            if self._validator is not None:
                self._validator.finish() if finished else self._validator.cancel()
        finally:
            store.prune(self.storage, self._first_index)


def job_env(storage: RunStorage) -> dict[str, str]:
    """The ranks' environment for a job starting now: the storage, and the latest
    committed checkpoint in it, which ``get_checkpoint()`` returns on every rank.

    Raises:
        CheckpointError: The run's folder could not be read.
    """
    entries = store.list_entries(storage)
    _remove_cut_off_named_folders(storage, entries)
    newest = latest(entries)
    if newest is None:
        logger.info("checkpoints go to %s (none there yet)", storage.run_path)
        return storage.to_env(None, next_index(entries))
    path = store.checkpoint_path(storage, newest)
    logger.info("checkpoints go to %s; the job resumes from %s", storage.run_path, path)
    return storage.to_env(path, next_index(entries))


def _remove_cut_off_named_folders(storage: RunStorage, entries: list[Entry]) -> None:
    """Before a job starts: the folders of earlier jobs' uploads to named folders that
    were cut off. Their markers stay, keeping their numbers taken, until the job's
    first commit removes them (``store._remove_unkept``). Logged if it fails."""
    for entry in entries:
        if entry.committed or entry.named is None:
            continue
        try:
            storage.filesystem.delete_dir(store.checkpoint_path(storage, entry))
        except FileNotFoundError:
            pass
        except storage_errors() as err:
            logger.warning("an unfinished checkpoint upload's folder stays: %s", err)
