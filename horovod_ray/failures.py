"""Who failed: look at every rank once a call failed, then decide without Ray.

A rank that loses a peer fails too, often before Ray reports the peer's death (Gloo sees
the closed socket first), and horovod may abort its process. So after a failure
:func:`probe` asks every rank for a sign of life (live ranks answer at once, even
mid-collective; dead ones fail the ping; ranks on a lost node stay silent), asks nodes
whose every rank died whether the node itself still runs, and returns a
:class:`Snapshot`. :func:`attribute` is a pure function of that snapshot: causes and
consequences, and :func:`error_for` the exception the caller sees.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import time
from typing import Any, Mapping, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.errors import (
    HorovodRayError,
    RendezvousError,
    WorkerFailedError,
    describe_failures,
)

# After a failure, seconds a rank (or a node) gets to answer before it is taken as lost.
LIVENESS_TIMEOUT_S = 5.0
# After a rank is found lost, seconds before the others are asked again: a lost node's
# processes do not all die at the same instant.
LOST_RECHECK_S = 1.0


class Seen(enum.Enum):
    """What was seen of a rank's process."""

    ALIVE = "alive"  # it answered (or its call returned or raised)
    DIED = "died"  # Ray reports the process dead
    UNREACHABLE = "unreachable"  # Ray cannot reach it (its node is going or gone)
    SILENT = "silent"  # no answer within LIVENESS_TIMEOUT_S


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
    """

    node_id: str
    where: str
    raised: str | None = None
    seen: Seen = Seen.ALIVE
    lost_text: str = ""
    joined: bool | None = True


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
    """Causes and consequences of a failure, from what :func:`probe` saw.

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


# ------------------------------------------------------------------------------ the I/O


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def describe(err: BaseException, where: str) -> str:
    """One rank's failure as a message line: what happened, where, the original text."""
    text = _ANSI.sub("", str(err))  # Ray colours its traceback headers
    if isinstance(err, ray.exceptions.RayActorError):
        return f"process died {where}: {text}"
    return f"raised {where}:\n{text}"


def error_of(ref: ray.ObjectRef) -> BaseException | None:
    """The error ``ref`` holds, None if it holds a value or is not ready."""
    try:
        ray.get(ref, timeout=0)
    except ray.exceptions.GetTimeoutError:
        return None
    except ray.exceptions.RayError as err:
        return err
    return None


def _seen_in(err: BaseException | None) -> Seen:
    if isinstance(err, ray.exceptions.ActorUnavailableError):
        return Seen.UNREACHABLE
    if isinstance(err, ray.exceptions.RayActorError):
        return Seen.DIED
    return Seen.ALIVE


def probe(
    workers: Sequence[Any],
    wheres: Sequence[str],
    node_ids: Sequence[str],
    refs: Sequence[ray.ObjectRef],
    joined: set[int] | None,
    elapsed_s: float,
    timeout_s: float,
) -> tuple[Snapshot, BaseException | None]:
    """Looks at every rank of a failed call (and at nodes whose every rank was lost).

    Args:
        workers: The ranks' actors, in world-rank order.
        wheres: Each rank's "on node ... (ip, pid ...)".
        node_ids: Each rank's node.
        refs: The failed call's refs: ``refs[r]`` is rank r's (fewer for a rank-0 call).
        joined: World ranks that joined the rendezvous; None when unknown.
        elapsed_s: How long the call ran.
        timeout_s: The job's Gloo timeout.

    Returns:
        The snapshot, and the first error raised by a rank (to chain from).
    """
    n = len(workers)
    raised: dict[int, BaseException] = {}
    seen: dict[int, tuple[Seen, str]] = {}
    # What had failed when the first failure was seen: the candidates for the cause.
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    for ref in ready:
        rank, err = list(refs).index(ref), error_of(ref)
        if _seen_in(err) is not Seen.ALIVE:
            seen[rank] = (_seen_in(err), describe(err, wheres[rank]))
        elif err is not None:
            raised[rank] = err
    _ping(workers, wheres, refs, [r for r in range(n) if r not in seen], seen)
    if seen and len(seen) < n:
        time.sleep(LOST_RECHECK_S)
        _ping(workers, wheres, refs, [r for r in range(n) if r not in seen], seen)

    views = []
    for rank in range(n):
        state, text = seen.get(rank, (Seen.ALIVE, ""))
        err = raised.get(rank)
        views.append(
            RankView(
                node_id=node_ids[rank],
                where=wheres[rank],
                raised=None if err is None else _ANSI.sub("", str(err)),
                seen=state,
                lost_text=text,
                joined=None if joined is None else rank in joined,
            )
        )
    snapshot = Snapshot(tuple(views), {}, elapsed_s, timeout_s)
    wholly = wholly_lost_nodes(snapshot)
    if wholly and len(wholly) < len(set(node_ids)):
        snapshot = dataclasses.replace(snapshot, node_alive=_nodes_alive(wholly))
    return snapshot, next(iter(raised.values()), None)


def _ping(
    workers: Sequence[Any],
    wheres: Sequence[str],
    refs: Sequence[ray.ObjectRef],
    ranks: list[int],
    seen: dict[int, tuple[Seen, str]],
) -> None:
    """Adds to ``seen`` those of ``ranks`` whose process died or that stay silent."""
    pings = {rank: workers[rank].ping.remote() for rank in ranks}
    _, silent = ray.wait(list(pings.values()), num_returns=len(pings), timeout=LIVENESS_TIMEOUT_S)
    for rank, ping in pings.items():
        # The call's own outcome first: a rank whose call died is lost whatever else.
        outcome = error_of(refs[rank]) if rank < len(refs) else None
        if _seen_in(outcome) is not Seen.ALIVE:
            seen[rank] = (_seen_in(outcome), describe(outcome, wheres[rank]))
        elif ping in silent:
            seen[rank] = (
                Seen.SILENT,
                f"did not answer within {LIVENESS_TIMEOUT_S:g}s {wheres[rank]}: the node "
                f"was lost or the process hung",
            )
        elif _seen_in(err := error_of(ping)) is not Seen.ALIVE:
            seen[rank] = (_seen_in(err), describe(err, wheres[rank]))


@ray.remote(num_cpus=0)
def _node_answers() -> bool:
    return True


def _nodes_alive(node_ids: set[str]) -> dict[str, bool]:
    """Whether each node still runs tasks: a no-op pinned to it, within the liveness time."""
    refs = {
        node: _node_answers.options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        ).remote()
        for node in node_ids
    }
    ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=LIVENESS_TIMEOUT_S)
    return {node: ref in ready and error_of(ref) is None for node, ref in refs.items()}
