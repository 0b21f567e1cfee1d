"""One rank's session: what a rank's process holds for its job, in one object.

The worker installs one for its process as it sets its rank up
(``worker.RankWorker.setup``), and ``run(local=True)`` one of its own for its call, in its
own thread (a rank's own local run is a job of its own, while the rank's control thread
still answers for the rank's). Each concern keeps its part here and reads
it through :func:`current`: ``logs`` (where ``log()`` dicts go), ``report`` (the upload
thread, a Tune trial's session), ``metrics``, ``datasets``, ``timeline``, ``preemption``
and ``dropped``. A process that is no rank's actor (the driver, a command line's
command) has the one made at import.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator


@dataclasses.dataclass(eq=False)
class RankSession:
    """A rank's state for its job, by the concern that keeps it.

    Attributes:
        channel: ``logs``: where ``log()`` dicts go: a ``LogChannel`` the driver polls
            (rank 0's, or every rank's in an elastic job), a local run's callbacks, or
            None (another rank of a static job; no rank).
        elastic: ``logs``: a rank of an elastic job, which posts while it is rank 0.
        uploader: ``report``: rank 0's upload thread, made at its first report with a
            storage path.
        tune: ``report``: the Tune trial's session the reports go to, or None.
        local: ``report``: a local run's one rank, whose reports are rank 0's whatever
            an enclosing job's horovod says.
        in_actor: ``report``: the process is a rank's actor, whose calls end with the
            uploads flushed.
        warned: ``report``: the warning that a checkpoint is kept nowhere was given.
        telemetry: ``metrics``: the rank's ``RankTelemetry``; None: no metrics.
        shards: ``datasets``: this rank's iterators by name; None: no datasets.
        data_waited: ``datasets``: seconds the rank waited for each dataset's batches.
        timeline: ``timeline``: horovod's timeline file on this rank, or None.
        timeline_ours: ``timeline``: that file is this package's, removed once read.
        notice: ``preemption``: the last notice ``get_preemption_info()`` gave here.
        asked: ``preemption``: the rank asked for notices (the driver then waits for
            the just-in-time checkpoint).
        waited: ``preemption``: the notice whose just-in-time checkpoint rank 0 waited
            after, in vain.
        to_drop: ``dropped``: the folders this rank reported to be dropped, not removed
            yet.
    """

    channel: Any = None
    elastic: bool = False
    uploader: Any = None
    tune: Any = None
    local: bool = False
    in_actor: bool = False
    warned: bool = False
    telemetry: Any = None
    shards: dict[str, Any] | None = None
    data_waited: dict[str, float] = dataclasses.field(default_factory=dict)
    timeline: str | None = None
    timeline_ours: bool = False
    notice: dict[str, Any] | None = None
    asked: bool = False
    waited: int = 0
    to_drop: list[str] = dataclasses.field(default_factory=list)


_session = RankSession()
_thread = threading.local()  # a local run's, in the thread that runs it


def current() -> RankSession:
    """This thread's session: a local run's in its thread, else the process's."""
    return getattr(_thread, "session", None) or _session


def install(session: RankSession) -> RankSession:
    """Makes ``session`` this process's, and returns the one it replaces."""
    global _session
    previous, _session = _session, session
    return previous


@contextlib.contextmanager
def installed(session: RankSession) -> Iterator[RankSession]:
    """``session`` is this thread's for the block (the process's other threads keep
    theirs); the one before is given back after."""
    previous = getattr(_thread, "session", None)
    _thread.session = session
    try:
        yield session
    finally:
        _thread.session = previous
