"""Nodes that Ray is draining: a spot node about to be preempted, an idle node the
autoscaler takes back, a node drained by hand (``ray drain-node``). Ray announces them
with a deadline, before the node dies; a job reads them here and leaves such a node in time.

An elastic job's discovery leaves a draining node out, so horovod's driver tells the ranks
at their next ``commit()`` and the job re-forms without that node and without a rollback.
A static job cannot re-form: it fails with :class:`~horovod_ray.errors.NodeDrainingError`
as soon as one of its nodes drains, instead of waiting for the node to die, once rank 0
(on a node that stays) has committed the checkpoints it was uploading, if the deadline
leaves time for it (:func:`upload_wait_s`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Mapping

import ray

from horovod_ray.errors import NodeDrainingError

logger = logging.getLogger(__name__)
_warned = threading.Event()  # a failure to read the draining nodes has been said

READ_EVERY_S = 1.0  # how often a static job asks whether one of its nodes drains
# What a static job stopped by a drain keeps of the nearest deadline, after letting rank
# 0's uploads finish, to stop its ranks; and its longest wait for them (no deadline given),
# which with rank 0's time to answer (5 s) stays below what stop() from another thread
# waits for a release (executor.STOP_WAIT_S, 60 s).
UPLOAD_MARGIN_S = 5.0
UPLOAD_WAIT_MAX_S = 45.0


def draining_nodes() -> dict[str, float]:
    """The draining nodes and the seconds left to each one's deadline (inf: none given).

    Ray has no public call for it; this reads the GCS as Ray Serve and Ray Data do. Where
    that fails (a Ray without the call, a Ray Client driver, a GCS hiccup), no node is
    seen draining, said once at WARNING: jobs then learn of a node's end when it dies.
    """
    try:
        deadlines = ray._private.state.state.get_draining_nodes()  # noqa: SLF001
    except Exception as err:  # noqa: BLE001 - said once, then read again next time
        if not _warned.is_set():
            _warned.set()
            logger.warning(
                "cannot read which Ray nodes are draining (%r); while it fails, jobs learn "
                "of a node's end when it dies",
                err,
            )
        logger.debug("reading the draining nodes failed", exc_info=True)
        return {}
    return seconds_left(deadlines, time.time())


def seconds_left(deadlines: Mapping[str, int], now_s: float) -> dict[str, float]:
    """Node id -> seconds from ``now_s`` to its deadline (GCS's ms since the epoch, where 0
    means none: inf), never below 0. Pure."""
    return {
        node_id: math.inf if deadline_ms == 0 else max(0.0, deadline_ms / 1000 - now_s)
        for node_id, deadline_ms in deadlines.items()
    }


class LeavingError(Exception):
    """Raised by :meth:`Watch.check`: node id -> seconds left to its deadline."""

    def __init__(self, leaving: dict[str, float]) -> None:
        super().__init__(leaving)
        self.leaving = leaving


class Watch:
    """Whether any of a job's nodes drains, asked of the GCS at most every ``interval_s``
    over all the job's calls (each call's waits ask it often: short calls in a loop, as
    ``horovod-ray run`` polls its ranks, are watched as one long call is). Once a node
    was seen draining, it stays so."""

    def __init__(self, node_ids: set[str], interval_s: float = READ_EVERY_S) -> None:
        self._node_ids, self._interval_s = set(node_ids), interval_s
        self._lock = threading.Lock()
        self._read_at = -math.inf
        self._seen: dict[str, float] = {}

    def draining(self) -> dict[str, float]:
        """The job's nodes that drain, with the seconds left to each one's deadline (as
        last read)."""
        with self._lock:
            if self._node_ids and time.monotonic() - self._read_at >= self._interval_s:
                self._read_at = time.monotonic()
                read = draining_nodes()
                self._seen.update({n: s for n, s in read.items() if n in self._node_ids})
            return dict(self._seen)

    def check(self) -> None:
        """Raises :class:`LeavingError` once one of the nodes drains (a call's waits call it)."""
        leaving = self.draining()
        if leaving:
            raise LeavingError(leaving)


def upload_wait_s(leaving: Mapping[str, float], rank0_node_id: str) -> float:
    """How long a static job stopped by a drain lets rank 0 finish the checkpoint uploads it
    has in flight before its ranks are killed (0: not at all). Pure.

    Rank 0 on a node that stays gets up to the nearest deadline less ``UPLOAD_MARGIN_S``
    (at most ``UPLOAD_WAIT_MAX_S``); rank 0 on a draining node gets no wait.

    Args:
        leaving: The draining nodes -> seconds left to each one's deadline (inf: none).
        rank0_node_id: Rank 0's node.
    """
    if not leaving or rank0_node_id in leaving:
        return 0.0
    return max(0.0, min(min(leaving.values()) - UPLOAD_MARGIN_S, UPLOAD_WAIT_MAX_S))


def static_job_error(
    ranks: Mapping[int, tuple[str, str]], leaving: Mapping[str, float]
) -> NodeDrainingError:
    """The error of a static job stopped because Ray drains some of its nodes. Pure.

    Args:
        ranks: World rank -> (where it runs, for messages; its node id).
        leaving: The draining nodes -> seconds left to each one's deadline.
    """
    failures = {
        rank: f"{where}, which Ray is draining ({describe(leaving[node_id])})"
        for rank, (where, node_id) in sorted(ranks.items())
        if node_id in leaving
    }
    heading = (
        "Ray is draining a node of the job (a preemption, or a node taken back); the job "
        "was stopped now rather than when the node dies. A static job cannot leave a "
        "node: run(max_restarts=N) starts it again on the nodes that stay, and an elastic "
        "job (min_workers=...) leaves such a node at a commit()."
    )
    lines = [heading, *(f"--- rank {rank}: {what}" for rank, what in failures.items())]
    return NodeDrainingError(failures, "\n".join(lines))


def describe(seconds: float) -> str:
    """``deadline in 30 s``, or ``no deadline``."""
    return "no deadline" if math.isinf(seconds) else f"deadline in {seconds:.0f} s"
