"""What a rank other than 0 does with the checkpoints it reports: it drops them, as Ray
Train's other workers' are, but never a folder rank 0 may still read.

The same ``report`` line runs on every rank, and the folder may be the one rank 0
reports (one that rank 0 wrote, or the one ``get_checkpoint()`` gave every rank): rank 0
copies it to its staging folder before its own ``report`` returns. So a folder goes at
this rank's next report, which comes after the training step between them (whose
collectives wait for rank 0, past its report), or when the next call starts or the job
stops it (:func:`drop_reported`), after every rank's call returned; never the folder
this report hands over. A command line's rank (no actor) keeps its last report's folder:
as it exits, nothing says rank 0 is done with it.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from horovod_ray.checkpoints.spec import RunStorage
from horovod_ray.rank import report_options as options
from horovod_ray.rank import session


def drop(checkpoint: Any) -> None:
    """Drops a report's checkpoint (None: one not to delete, or none): removes the folders
    of the reports before it, and keeps its own for later.

    Raises:
        ConfigError: The folder is in the run's storage (naming
            delete_local_checkpoint_after_upload, as on rank 0); nothing is removed.
    """
    folder = None
    if checkpoint is not None and options.on_this_node(checkpoint):
        storage = RunStorage.from_env()
        if storage is not None:
            options.outside_the_run(checkpoint, storage)
        folder = os.path.realpath(checkpoint.path)
    drop_reported(keep=folder)
    to_drop = session.current().to_drop
    if folder is not None and folder not in to_drop:
        to_drop.append(folder)


def drop_reported(keep: str | None = None) -> None:
    """Removes the folders this rank reported to be dropped, all but ``keep``; run as a
    rank's call starts and as the job stops it."""
    to_drop = session.current().to_drop
    for folder in to_drop:
        if folder != keep:
            shutil.rmtree(folder, ignore_errors=True)
    to_drop[:] = [keep] if keep in to_drop else []
