"""Nodes that Ray is draining: a spot node about to be preempted, an idle node the
autoscaler takes back, a node drained by hand (``ray drain-node``). Ray announces them
with a deadline, before the node dies; a job reads them here and leaves such a node in time.

An elastic job's discovery leaves a draining node out, so horovod's driver tells the ranks
at their next ``commit()`` and the job re-forms without that node and without a rollback.
A static job cannot re-form. It tells its ranks (``get_preemption_info()``, see
``rank/preemption.py``) and, where rank 0's function asks for the notice and the job has
a storage path, lets them go on until rank 0 has committed its just-in-time checkpoint,
within the deadline (:class:`Grace`). Then it fails with
:class:`~horovod_ray.errors.NodeDrainingError`, instead of waiting for the node to die,
once rank 0 (on a node that stays) has committed the checkpoints it was uploading, if the
deadline leaves time for it (:func:`upload_wait_s`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Mapping

import ray

from horovod_ray.errors import NodeDrainingError
from horovod_ray.failures import probe
from horovod_ray.rank import preemption

logger = logging.getLogger(__name__)
_warned = threading.Event()  # a failure to read the draining nodes has been said

READ_EVERY_S = 1.0  # how often a static job asks whether one of its nodes drains
# What a static job stopped by a drain keeps of the nearest deadline, after letting rank
# 0's uploads finish, to stop its ranks; and its longest wait for them (no deadline given),
# which with rank 0's time to answer (5 s) stays below what stop() from another thread
# waits for a release (lifecycle.STOP_WAIT_S, 60 s).
UPLOAD_MARGIN_S = 5.0
UPLOAD_WAIT_MAX_S = 45.0
# The longest a static job waits for rank 0's just-in-time checkpoint when the drain gave
# no deadline (with one: up to it, less UPLOAD_MARGIN_S).
JUST_IN_TIME_NO_DEADLINE_S = 60.0
ASK_RANK0_EVERY_S = 0.25  # how often the job asks rank 0 whether that checkpoint is in
TELL_WAIT_S = 5.0  # the longest the job waits for its ranks to take a notice


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


def just_in_time_s(leaving: Mapping[str, float]) -> float:
    """How long a static job lets its ranks go on after a drain, for rank 0's
    just-in-time checkpoint: to the nearest deadline less ``UPLOAD_MARGIN_S``, or
    ``JUST_IN_TIME_NO_DEADLINE_S`` without one. Pure."""
    nearest = min(leaving.values())
    if math.isinf(nearest):
        return JUST_IN_TIME_NO_DEADLINE_S
    return max(0.0, nearest - UPLOAD_MARGIN_S)


def deadline_ms(leaving: Mapping[str, float], now_s: float) -> int | None:
    """The nearest deadline as Ray Train gives it (ms since the epoch), or None. Pure."""
    nearest = min(leaving.values())
    return None if math.isinf(nearest) else int((now_s + nearest) * 1000)


class Grace:
    """A static job's answer to a drain while its ranks run, asked at every wait of a call
    (:meth:`check`): tells every rank once more nodes drain (``get_preemption_info()``), then
    raises :class:`LeavingError` when the job should stop: at once, untold, where the job
    keeps no checkpoints; once rank 0 answers, where its function never asked for the
    notice; else once rank 0 has committed the checkpoint it reported after the notice
    (its ``report()`` then waits to be stopped), or at :func:`just_in_time_s`. Calls
    from several threads share it (a lock).

    Args:
        watch: The job's nodes' drains.
        actors: The ranks' actors, in world-rank order.
        nodes: Each world rank's node id.
        keeps_checkpoints: Whether the job has a storage path (rank 0's reports persist).
    """

    def __init__(
        self, watch: Watch, actors: list[Any], nodes: list[str], keeps_checkpoints: bool
    ) -> None:
        self._watch, self._actors, self._nodes = watch, actors, nodes
        self._keeps = keeps_checkpoints
        self._told: set[str] = set()
        self._version = 0
        self._until = math.inf
        self._asking: Any = None
        self._asked_at = -math.inf
        self._state: tuple[bool, bool] | None = None  # rank 0's (asked, saved); None: unknown
        self._unread: list[Any] = []  # the refs of notices not taken within TELL_WAIT_S
        self._lock = threading.Lock()

    def check(self) -> None:
        leaving = self._watch.draining()
        if not leaving:
            return
        if not self._keeps:
            raise LeavingError(leaving)  # nothing a checkpoint could be kept in
        with self._lock:
            if not set(leaving) <= self._told:
                self._tell(leaving)
            if self._stop_now():
                raise LeavingError(leaving)

    def finish_uploads(self, leaving: Mapping[str, float]) -> None:
        """Lets rank 0 commit the checkpoints it has in flight, for as long as the drain's
        deadline allows (:func:`upload_wait_s`): killed now, it would leave them
        uncommitted, and a restart would go back to the one before. The ranks go on
        meanwhile; rank 0's node must be one that stays."""
        wait_s = upload_wait_s(leaving, self._nodes[0]) if self._nodes else 0.0
        if wait_s <= 0:
            return
        began = time.monotonic()
        ref = self._actors[0].finish_uploads.remote(wait_s)
        ready, _ = ray.wait([ref], timeout=wait_s + probe.LIVENESS_TIMEOUT_S)
        finished = bool(ready) and probe.error_of(ref) is None and ray.get(ref)
        if not finished:
            logger.warning(
                "rank 0's checkpoint uploads did not finish within %.0f s of the drain; "
                "the one in flight is cut off",
                wait_s,
            )
        else:
            logger.debug("rank 0's uploads done %.1f s after the drain", time.monotonic() - began)

    def settle(self) -> None:
        """Reads what the ranks' actors answered after the job stopped (so that Ray does
        not log the failures of the killed ones as unhandled)."""
        with self._lock:
            for ref in [*self._unread, *([self._asking] if self._asking is not None else [])]:
                probe.error_of(ref)
            self._unread, self._asking = [], None

    def _tell(self, leaving: Mapping[str, float]) -> None:
        """Writes the next notice to every rank, and how long the ranks may go on."""
        self._version += 1
        self._told = set(leaving)
        node_ranks = {
            node: [rank for rank, there in enumerate(self._nodes) if there == node]
            for node in leaving
        }
        text = preemption.notice(
            self._version, deadline_ms(leaving, time.time()), node_ranks, restart=True
        )
        self._unread = tell(self._actors, [(self._version, text)])
        self._until = min(self._until, time.monotonic() + just_in_time_s(leaving))
        logger.warning(
            "a node of the job is draining (%s): the ranks are told (get_preemption_info)",
            describe(min(leaving.values())),
        )

    def _stop_now(self) -> bool:
        if time.monotonic() >= self._until:
            if self._state is not None and self._state[0] and not self._state[1]:
                logger.warning(
                    "rank 0 asked for the preemption notice but committed no checkpoint "
                    "reported after it in time; the job stops now"
                )
            return True
        state = self._rank0_state()
        return state is not None and (state[1] or not state[0])

    def _rank0_state(self) -> tuple[bool, bool] | None:
        """Rank 0's last answer (asked, saved), asked again at most every
        ``ASK_RANK0_EVERY_S``; None before the first."""
        if self._asking is not None and ray.wait([self._asking], timeout=0)[0]:
            if probe.error_of(self._asking) is None:
                self._state = ray.get(self._asking)
            self._asking = None
        if self._asking is None and time.monotonic() - self._asked_at >= ASK_RANK0_EVERY_S:
            self._asked_at = time.monotonic()
            self._asking = self._actors[0].preemption_state.remote()
        return self._state


def tell(actors: list[Any], notices: list[tuple[int, str]]) -> list[Any]:
    """Hands each actor's rank the notices (number, text), waiting up to ``TELL_WAIT_S``;
    the refs not answered by then (a dead rank is the call's to find)."""
    refs = [actor.preempt.remote(n, text) for actor in actors for n, text in notices]
    ready, unread = ray.wait(refs, num_returns=len(refs), timeout=TELL_WAIT_S)
    for ref in ready:
        probe.error_of(ref)
    return unread


class Notices:
    """An elastic run's preemption notices, numbered from 1, each written once: a new one
    when the discovery sees a node that holds ranks drain, naming every such node so far
    (they only inform: the ranks leave at a ``commit()``). Slot threads read them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: list[str] = []
        self._nodes: dict[str, tuple[list[int], int | None]] = {}

    def add(self, node_id: str, ranks: list[int], deadline_ms: int | None) -> None:
        """A node that held ``ranks`` drains (none: an idle node, no notice)."""
        if not ranks:
            return
        with self._lock:
            self._nodes[node_id] = (ranks, deadline_ms)
            deadlines = [d for _, d in self._nodes.values() if d is not None]
            node_ranks = {node: r for node, (r, _) in self._nodes.items()}
            number = len(self._texts) + 1
            text = preemption.notice(number, min(deadlines, default=None), node_ranks, False)
            self._texts.append(text)

    def since(self, told: int) -> list[tuple[int, str]]:
        """The notices after number ``told``, as (number, text)."""
        with self._lock:
            return [(n, text) for n, text in enumerate(self._texts, 1) if n > told]
