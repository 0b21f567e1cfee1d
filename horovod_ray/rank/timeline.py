"""Where a rank writes horovod's timeline for ``settings.timeline``, and reading it back.

The driver asks for it (``TIMELINE_ENV``); each rank picks a file in its own node's
temporary folder (horovod writes only rank 0's), unless ``HOROVOD_TIMELINE`` already
names one. The file is handed to the driver as the job stops (``Worker.take_timeline``,
after horovod's shutdown has written it whole), written to the driver's path
(:func:`bring`, the driver's half) and removed if it is this package's; one left by a
killed rank is removed by the next rank started on its node.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from typing import Any

from horovod_ray.checkpoints.leftovers import owned, sweep_stale
from horovod_ray.rank import frameworks, session

logger = logging.getLogger(__name__)

# Set by the driver when settings.timeline asks for the file.
TIMELINE_ENV = "HOROVOD_RAY_TIMELINE"
# A file's name: this prefix, the process id, "-" and the job's id.
PREFIX = "horovod_ray-timeline-"

# Longest the hand-over waits for horovod's shutdown (the driver waits 10 s for it).
SHUTDOWN_WAIT_S = 5.0
# Longest the driver waits for rank 0's timeline file as the job stops (bring()).
TAKE_FILE_S = 10.0


def choose() -> None:
    """Sets ``HOROVOD_TIMELINE`` for this rank's horovod when the job asked for one."""
    if not os.environ.get(TIMELINE_ENV):
        return
    sweep_stale((PREFIX,))
    now = session.current()
    now.timeline = os.environ.get("HOROVOD_TIMELINE")
    if not now.timeline:
        job_id = os.environ.get("HOROVOD_RAY_JOB_ID", "job")
        now.timeline = os.path.join(tempfile.gettempdir(), f"{owned(PREFIX)}{job_id}.json")
        os.environ["HOROVOD_TIMELINE"] = now.timeline
        now.timeline_ours = True


def take() -> bytes | None:
    """The timeline's bytes (None: no file); this package's file is removed.

    horovod is shut down first (the job is stopping): its writer holds the last events
    in a buffer until then, often the last collective's ends. Not for longer than
    ``SHUTDOWN_WAIT_S``: after another rank failed, horovod's thread may wait in a
    collective until Gloo's timeout, and the file as it is then is worth more than none.
    """
    now = session.current()
    if now.timeline is None:
        return None
    ending = threading.Thread(target=_shut_down, name="horovod_ray-timeline", daemon=True)
    ending.start()
    ending.join(SHUTDOWN_WAIT_S)
    try:
        with open(now.timeline, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None
    if now.timeline_ours:
        os.remove(now.timeline)
    return data


def _shut_down() -> None:
    try:
        frameworks.shut_down()
    except Exception:  # noqa: BLE001 - the file is read all the same
        logger.debug("horovod's shutdown before the timeline's hand-over failed", exc_info=True)


def bring(rank0: Any, target: str) -> None:
    """The driver's half: writes rank 0's timeline (its actor's :func:`take`) to ``target``
    as a static job stops; what goes wrong is a warning (the job is being stopped either
    way)."""
    import ray

    try:
        data = ray.get(rank0.take_timeline.remote(), timeout=TAKE_FILE_S)
        if data is None:
            logger.warning("rank 0 wrote no timeline: did the job call hvd.init()?")
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as handle:
            handle.write(data)
    except Exception as err:  # noqa: BLE001 - never in the way of the release
        logger.warning("horovod's timeline was not written to %s: %s", target, err)
        return
    logger.info("horovod's timeline: %s", target)
