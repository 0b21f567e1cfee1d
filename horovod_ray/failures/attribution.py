"""Who failed and what the caller sees, for both kinds of job: pure functions, no Ray.

* A static job: after a call failed, ``probe.probe`` looks at every rank and returns a
  :class:`Snapshot`; :func:`attribute` separates causes from consequences (a rank that
  loses a peer fails too) and :func:`error_for` is the exception the caller sees.
* An elastic job: horovod's driver recovers from lost ranks and nodes itself (the
  survivors reset); when a run ends, :func:`elastic_error` decides from an
  :class:`ElasticEnd` whether it failed, and why (too few slots for too long, too many
  resets, ranks that failed in the last world).

A static job that hung (a stall, a silent network) is told apart in ``hangs``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

from horovod_ray.errors import (
    ElasticLimitError,
    HorovodRayError,
    RendezvousError,
    WorkerFailedError,
    describe_failures,
)


class Seen(enum.Enum):
    """What was seen of a rank's process."""

    ALIVE = "alive"  # it answered (or its call returned or raised)
    DIED = "died"  # Ray reports the process dead
    UNREACHABLE = "unreachable"  # Ray cannot reach it (its node is going or gone)
    SILENT = "silent"  # no answer within probe.LIVENESS_TIMEOUT_S


LOST = frozenset({Seen.DIED, Seen.UNREACHABLE, Seen.SILENT})


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank after a failure.

    Attributes:
        node_id: Its node.
        where: "on node ... (ip, pid ...)", for messages.
        raised: The error text if its call had raised when the failure was first seen.
        seen: The worst seen of its process, over its call and the pings.
        lost_text: Why it is taken as lost (set when ``seen`` is in LOST).
        joined: Whether it ever joined the rendezvous (None when that is unknown).
        running: Whether its call was still running when it was looked at.
    """

    node_id: str
    where: str
    raised: str | None = None
    seen: Seen = Seen.ALIVE
    lost_text: str = ""
    joined: bool | None = True
    running: bool = False


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Every rank of a job after a failure, in world-rank order, and its nodes' state."""

    ranks: tuple[RankView, ...]
    # Node id -> whether the node itself answered (asked only of nodes whose every rank
    # was lost); absent when not asked.
    node_alive: Mapping[str, bool] = dataclasses.field(default_factory=dict)
    elapsed_s: float = 0.0
    timeout_s: float = float("inf")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What caused a failure.

    Attributes:
        kind: "lost" (ranks died or went silent), "raised", or "rendezvous" (ranks never
            joined the rendezvous within the timeout).
        causes: World rank -> what happened to it.
        consequences: Ranks that failed only because they lost their peers.
        stuck: With "rendezvous", the live ranks that never joined.
    """

    kind: str
    causes: dict[int, str]
    consequences: frozenset[int] = frozenset()
    stuck: tuple[int, ...] = ()


def gone_nodes(snapshot: Snapshot) -> set[str]:
    """The nodes taken as lost.

    A node is gone when one of its ranks cannot be reached or stays silent. A node whose
    every rank died is gone too unless it answered itself (then horovod aborted its ranks
    after a peer was lost), or unless nothing survived anywhere (then no node can be told
    from another).
    """
    gone = {v.node_id for v in snapshot.ranks if v.seen in (Seen.UNREACHABLE, Seen.SILENT)}
    wholly = wholly_lost_nodes(snapshot)
    if len(wholly) < len({v.node_id for v in snapshot.ranks}):
        gone |= {node for node in wholly if not snapshot.node_alive.get(node, False)}
    return gone


def wholly_lost_nodes(snapshot: Snapshot) -> set[str]:
    """The nodes all of whose ranks were lost."""
    lost_everywhere: dict[str, bool] = {}
    for view in snapshot.ranks:
        lost_everywhere[view.node_id] = lost_everywhere.get(view.node_id, True) and (
            view.seen in LOST
        )
    return {node for node, lost in lost_everywhere.items() if lost}


def attribute(snapshot: Snapshot) -> Verdict:
    """Causes and consequences of a failure, from what ``probe.probe`` saw.

    Lost ranks (dead, unreachable, silent) are the cause when there are any, except lost
    ranks on nodes that are not gone while another node is: those followed it. Without
    lost ranks, the ranks that raised are. Live ranks that never joined the rendezvous,
    while no rank that did failed on its own, with the timeout passed: a rendezvous
    timeout.
    """
    views = snapshot.ranks
    lost = {r: v for r, v in enumerate(views) if v.seen in LOST}
    gone = gone_nodes(snapshot)
    followers = {r for r, v in lost.items() if v.node_id not in gone} if gone else set()
    causes_lost = {r: v.lost_text for r, v in lost.items() if r not in followers}
    raised = {r: v.raised for r, v in enumerate(views) if v.raised and r not in lost}

    missing = [r for r, v in enumerate(views) if v.joined is False]
    stuck = tuple(r for r in missing if r not in raised and r not in lost)
    failed = set(raised) | set(lost)
    if stuck and not failed & set(missing) and snapshot.elapsed_s >= snapshot.timeout_s:
        seen = {r: f"raised {views[r].where}:\n{text}" for r, text in raised.items()}
        seen.update({r: v.lost_text for r, v in lost.items()})
        return Verdict("rendezvous", dict(sorted(seen.items())), stuck=stuck)
    if causes_lost:
        return Verdict("lost", causes_lost, frozenset(set(raised) | followers))
    return Verdict("raised", {r: f"raised {views[r].where}:\n{t}" for r, t in raised.items()})


def error_for(verdict: Verdict, timeout_s: float) -> HorovodRayError:
    """The exception a caller sees for ``verdict``."""
    if verdict.kind == "rendezvous":
        noun = "rank" if len(verdict.stuck) == 1 else "ranks"
        return RendezvousError(
            f"{noun} {', '.join(map(str, verdict.stuck))} never joined the Gloo rendezvous "
            f"within timeout_s={timeout_s:g}s (does every rank call hvd.init()?); the job "
            f"was stopped. The ranks that waited:\n"
            + "\n".join(f"--- rank {r}: {text}" for r, text in verdict.causes.items())
        )
    if verdict.kind == "lost" and verdict.consequences:
        followers = ", ".join(map(str, sorted(verdict.consequences)))
        return WorkerFailedError(
            verdict.causes,
            f"{describe_failures(verdict.causes)}\nRanks {followers} failed after losing "
            f"their peers (not the cause).",
        )
    return WorkerFailedError(verdict.causes)


# ------------------------------------------------------------------------ elastic jobs


@dataclasses.dataclass(frozen=True)
class ElasticEnd:
    """How an elastic run ended, as its driver and its slots saw it.

    Attributes:
        available: Slots the cluster could hold at the end (capped at ``max_workers``).
        timed_out_waiting: A wait for ``min_workers`` slots timed out (at start or in a
            reset).
        crashed: The driver's own thread raised this (not a rank's failure).
        driver_message: Why horovod's driver stopped, "" when it did not give up.
        reset_limit_hit: ``driver_message`` says the reset limit was passed.
        exit_failed: Some slot of the final world ended with a non-zero code.
        final_size: Ranks in the final world.
        num_results: Results the final world returned.
        last_failures: World rank -> what failed, in the final world only (earlier worlds'
            failures were recovered from).
    """

    available: int
    timed_out_waiting: bool = False
    crashed: BaseException | None = None
    driver_message: str = ""
    reset_limit_hit: bool = False
    exit_failed: bool = False
    final_size: int = 0
    num_results: int = 0
    last_failures: Mapping[int, str] = dataclasses.field(default_factory=dict)


def elastic_error(
    end: ElasticEnd, min_workers: int, reset_limit: int | None, elastic_timeout_s: float
) -> HorovodRayError | None:
    """The exception an elastic run that ended so raises; None when it succeeded.

    Too few slots for too long comes first (a timed-out wait is why the driver stopped,
    whatever else it says), then a crash of the driver itself, then the reset limit,
    then ranks of the final world that failed or returned nothing.
    """
    if end.timed_out_waiting:
        return ElasticLimitError(
            "min_workers",
            min_workers,
            end.available,
            f"elastic job stopped: fewer than min_workers={min_workers} ranks could be "
            f"placed for elastic_timeout={elastic_timeout_s:g}s (wanted {min_workers}, the "
            f"cluster could hold {end.available}); add capacity or lower min_workers",
        )
    if end.crashed is not None:
        return HorovodRayError(f"elastic job failed: {end.crashed}")
    if end.reset_limit_hit:
        return ElasticLimitError(
            "reset_limit",
            min_workers,
            end.available,
            f"elastic job stopped: more than reset_limit={reset_limit} resets (wanted at "
            f"least {min_workers} ranks, the cluster could hold {end.available}); resets "
            f"for growth count too",
        )
    if end.driver_message or end.exit_failed or end.num_results != end.final_size:
        failed = dict(end.last_failures)
        if end.driver_message:
            failed.setdefault(-1, f"horovod's elastic driver gave up: {end.driver_message}")
        return WorkerFailedError(failed or {-1: "the job ended without every result"})
    return None
