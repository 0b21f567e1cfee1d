"""Where a rank writes horovod's timeline for ``settings.timeline``, and reading it back.

The driver asks for it (``TIMELINE_ENV``); each rank picks a file in its own node's
temporary folder (horovod writes only rank 0's), unless ``HOROVOD_TIMELINE`` already
names one. The file is handed to the driver as the job stops (``Worker.take_timeline``,
after horovod's shutdown has written it whole) and removed if it is this package's;
one left by a killed rank is removed by the next rank started on its node.
"""

from __future__ import annotations

import os
import tempfile

from horovod_ray.checkpoints.leftovers import owned, sweep_stale
from horovod_ray.rank import frameworks

# Set by the driver when settings.timeline asks for the file.
TIMELINE_ENV = "HOROVOD_RAY_TIMELINE"
# A file's name: this prefix, the process id, "-" and the job's id.
PREFIX = "horovod_ray-timeline-"

_path: str | None = None
_ours = False


def choose() -> None:
    """Sets ``HOROVOD_TIMELINE`` for this rank's horovod when the job asked for one."""
    global _path, _ours
    if not os.environ.get(TIMELINE_ENV):
        return
    sweep_stale((PREFIX,))
    _path = os.environ.get("HOROVOD_TIMELINE")
    if not _path:
        job_id = os.environ.get("HOROVOD_RAY_JOB_ID", "job")
        _path = os.path.join(tempfile.gettempdir(), f"{owned(PREFIX)}{job_id}.json")
        os.environ["HOROVOD_TIMELINE"] = _path
        _ours = True


def take() -> bytes | None:
    """The timeline's bytes (None: no file); this package's file is removed.

    horovod is shut down first (the job is stopping): its writer holds the last events
    in a buffer until then, often the last collective's ends.
    """
    if _path is None:
        return None
    frameworks.shut_down()
    try:
        with open(_path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    if _ours:
        os.remove(_path)
    return data
