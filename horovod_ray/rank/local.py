"""``run(..., local=True)``: the training function in the caller's own process, as the
one rank of a Horovod job, without Ray: a debugger (``pdb.set_trace()``, an IDE's
breakpoints) stops in it as in any Python code.

The process gets a rank's environment for the call (restored after it): ``hvd.init()``
makes a job of one, ``report``/``log`` reach the callbacks and, with a storage path, the
checkpoints persist as rank 0's do; ``get_checkpoint()`` and ``get_context()`` answer as
on a rank. horovod is shut down when the call ends, so the next call starts afresh.
Datasets (``datasets=``) go whole to this one rank, read through the Ray that made them.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, Sequence

import ray

from horovod_ray.checkpoints.job import JobCheckpoints
from horovod_ray.checkpoints.spec import CHECKPOINT_ENV, FIRST_INDEX_ENV, STORAGE_ENV
from horovod_ray.checkpoints.validation import VALIDATION_ENV
from horovod_ray.data.feed import DatasetFeed
from horovod_ray.data.spec import DataSpec, check_rows
from horovod_ray.observe.job import JobTelemetry
from horovod_ray.rank import datasets, frameworks, report, session
from horovod_ray.rank.ordered import OrderedShard
from horovod_ray.rank.preemption import PREEMPTION_DIR_ENV
from horovod_ray.rank.timeline import TIMELINE_ENV

logger = logging.getLogger(__name__)

# A job of one: what the executor gives each rank, for rank 0 of 1.
_ONE = {
    "HOROVOD_RANK": "0",
    "HOROVOD_SIZE": "1",
    "HOROVOD_LOCAL_RANK": "0",
    "HOROVOD_LOCAL_SIZE": "1",
    "HOROVOD_CROSS_RANK": "0",
    "HOROVOD_CROSS_SIZE": "1",
    "HOROVOD_CONTROLLER": "gloo",
    "HOROVOD_CPU_OPERATIONS": "gloo",
}


# An enclosing job's variables, which must not leak into a job of one (run(local=True)
# inside a rank): its rendezvous, its storage, what its ranks record.
_OUTER = (
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
    "HOROVOD_GLOO_RENDEZVOUS_BATCH",
    "HOROVOD_GLOO_IFACE",
    "HOROVOD_HOSTNAME",
    "HOROVOD_ELASTIC",
    "HOROVOD_RAY_ATTEMPT",
    "HOROVOD_RAY_METRICS",
    TIMELINE_ENV,
    PREEMPTION_DIR_ENV,
    STORAGE_ENV,
    CHECKPOINT_ENV,
    FIRST_INDEX_ENV,
    VALIDATION_ENV,
)


class _Direct:
    """A log channel that hands each item to the callbacks at once (no driver to poll)."""

    def __init__(self, callbacks: Sequence[Callable[[dict], None]]) -> None:
        self._callbacks = callbacks

    def put(self, item: object, delivery: object = None) -> None:
        for callback in self._callbacks:
            callback(item)

    def put_and_wait_delivered(self, item: object) -> None:
        self.put(item)


def run_here(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    settings: Any,
    callbacks: Sequence[Callable[[dict], None]],
    env: Mapping[str, str],
    data: DataSpec | None = None,
) -> list[Any]:
    """``fn(*args, **kwargs)`` here as rank 0 of 1; its result in a list, as ``run()``'s.
    ``settings`` are run()'s ``Settings`` (the storage, the timeline, the job's name);
    ``data`` the datasets, whole to this one rank.

    Raises:
        CheckpointError: The storage could not be read, or an upload failed.
        Whatever ``fn`` raises, as it raised it.
    """
    telemetry = JobTelemetry.of(settings, False, getattr(fn, "__name__", None))
    rank_env = {**_ONE, **{k: v for k, v in telemetry.rank_env().items() if "METRICS" not in k}}
    checkpoints = None
    if settings.storage is not None:
        checkpoints = JobCheckpoints(settings.storage, settings.validation, in_process=True)
        rank_env.update(checkpoints.rank_env())
    if settings.timeline is not None:
        rank_env["HOROVOD_TIMELINE"] = settings.timeline
        _timeline_folder(settings.timeline)
    rank_env = {**rank_env, **env}
    rank_env.pop(TIMELINE_ENV, None)
    saved = {key: os.environ.get(key) for key in {*rank_env, *_OUTER}}
    running_before = frameworks.running()
    for key in _OUTER:
        os.environ.pop(key, None)  # an enclosing job's (a rank's own run(local=True))
    os.environ.update(rank_env)
    feed = None if data is None else DatasetFeed(data, {})
    finished = False
    # A session of its own: an enclosing rank's log channel, upload thread, Tune session
    # and datasets are not this run's, and its reports are rank 0's.
    here = session.RankSession(channel=_Direct(callbacks), local=True)
    try:
        with session.installed(here):
            try:
                try:
                    if checkpoints is not None:
                        checkpoints.start()
                    if feed is not None:
                        check_rows(data, 1)
                        datasets.give(_one_ranks_shards(feed))
                    result = fn(*args, **kwargs)
                    report.flush()  # its checkpoints are persisted before run() returns
                    finished = True
                    return [result]
                finally:
                    try:
                        for key, value in saved.items():
                            if value is None:
                                os.environ.pop(key, None)
                            else:
                                os.environ[key] = value
                        if feed is not None:
                            feed.close()
                    finally:
                        frameworks.shut_down(keep=running_before)  # its timeline is then whole
                        if settings.timeline is not None and not os.path.exists(settings.timeline):
                            logger.warning(
                                "horovod wrote no timeline to %s: did the function call "
                                "hvd.init()?",
                                settings.timeline,
                            )
            finally:
                report.close_uploader()  # this run's, once flushed
    finally:
        if checkpoints is not None:
            checkpoints.end(finished)  # validated, then pruned


def _timeline_folder(path: str) -> None:
    """Makes the timeline's folder, as a job on Ray does: horovod writes nothing, and
    says nothing, where it is missing."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as err:
        logger.warning("horovod's timeline cannot be written to %s: %s", path, err)


def _one_ranks_shards(feed: DatasetFeed) -> dict[str, Any]:
    """The datasets for the one rank: streamed, or in order when resumable."""
    if not feed.spec.resumable:
        return feed.open([ray.get_runtime_context().get_node_id()])[0]
    ordered, whole = feed.materialize(None)
    return {**whole, **{name: OrderedShard(name, d, rows) for name, (d, rows) in ordered.items()}}
