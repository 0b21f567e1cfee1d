"""Who failed and what the caller sees, for both kinds of job: pure functions, no Ray.

* A static job: after a call failed, ``probe.probe`` looks at every rank and returns a
  :class:`Snapshot`; :func:`attribute` separates causes from consequences (a rank that
  loses a peer fails too) and :func:`error_for` is the exception the caller sees.
* An elastic job: horovod's driver recovers from lost ranks and nodes itself (the
  survivors reset); when a run ends, :func:`elastic_error` decides from an
  :class:`ElasticEnd` whether it failed, and why (too few slots for too long, too many
  resets, ranks that failed in the last world).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Mapping, Sequence

from horovod_ray.errors import (
    ElasticLimitError,
    HangError,
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


# -------------------------------------------------------------------- a stalled job

# What horovod raises in every pending collective once it shut down (common.h).
SHUT_DOWN_TEXT = "Horovod has been shut down"
# One line of the stall inspector's report: a rank ("!": past the shutdown time) and the
# collectives it has not entered, e.g. "1!: [HorovodAllreduce_Const_0]".
_MISSING_LINE = re.compile(r"(\d+)(!?): \[(.*)\]")


@dataclasses.dataclass(frozen=True)
class Stall:
    """Ranks that never reached a collective, and the ranks that waited in it."""

    missing: tuple[int, ...]
    waiting: tuple[int, ...]
    collectives: Mapping[int, str] = dataclasses.field(default_factory=dict)


def stall_report(text: str) -> dict[int, tuple[bool, str]]:
    """horovod's last stall report in ``text`` (rank 0's stderr): rank -> (past the
    shutdown time, the collectives it has not entered); empty without one."""
    start = text.rfind("Missing ranks:")
    if start < 0:
        return {}
    report = {}
    for line in text[start:].splitlines()[1:]:
        found = _MISSING_LINE.fullmatch(line.strip())
        if found is None:
            break
        report[int(found[1])] = (found[2] == "!", found[3])
    return report


def stalled(snapshot: Snapshot, report: Mapping[int, tuple[bool, str]]) -> Stall | None:
    """Whether horovod shut the job down for a stall, and who stalled.

    It did when every rank that raised, raised horovod's shut-down error, no rank was
    lost, and the stall report names ranks past the shutdown time (a rank waiting in
    another collective raises too) or live ranks were still in the call. The missing
    ranks are those the report marks past the shutdown time, with the ranks it names as
    missing from a collective that one of those entered (ranks out of step: each misses
    the other's collective, and at the check that shuts down, only the one that misses
    the older collective may be past the time); else every rank it names, else the live
    ranks still in the call. The others waited. With blocking collectives a rank that
    entered one waits in it; one submitted asynchronously may have been left.
    """
    views = snapshot.ranks
    raised = [r for r, v in enumerate(views) if v.raised]
    running = [r for r, v in enumerate(views) if v.running and not v.raised]
    report = {r: entry for r, entry in report.items() if r < len(views)}
    past = [r for r, (over, _) in report.items() if over]
    if any(v.seen in LOST for v in views) or not raised or not (running or past):
        return None
    if not all(SHUT_DOWN_TEXT in views[r].raised for r in raised):
        return None
    missing = tuple(sorted(_out_of_step(report, past) or report or running))
    waiting = tuple(r for r in range(len(views)) if r not in missing)
    return Stall(missing, waiting, {r: report[r][1] for r in missing if r in report})


def _out_of_step(report: Mapping[int, tuple[bool, str]], past: Sequence[int]) -> set[int]:
    """The ranks past the shutdown time, and the ranks named as missing from a
    collective that one of them entered (one of the report's that it is not named for).

    Each rank's names are sorted and shortened after six ("..."): a shortened line says
    nothing of the names after its last, so those are not taken as entered.
    """
    missed = {r: _collectives(text) for r, (_, text) in report.items()}
    every = set().union(*missed.values())
    entered: set[str] = set()
    for rank in past:
        names = missed[rank]
        if report[rank][1].endswith(" ..."):  # only the names up to its last one are known
            known = {n for n in every if n <= max(names, default="")}
        else:
            known = every
        entered |= known - names
    return set(past) | {r for r, names in missed.items() if names & entered}


def _collectives(text: str) -> set[str]:
    """The names in one line of the report ("a, b, c, d, e, f ..." when horovod
    shortened it; a name of the user's own with ", " in it reads as two)."""
    return {name for name in text.removesuffix(" ...").split(", ") if name}


def hang_error(
    stall: Stall, snapshot: Snapshot, stall_timeout_s: float, stacks: Mapping[int, str]
) -> HangError:
    """The error a stalled job raises: who was missing, who waited, where the missing
    ranks were (their stacks), and which collectives they did not reach."""
    missing, waiting = ", ".join(map(str, stall.missing)), ", ".join(map(str, stall.waiting))
    failures = {}
    for rank in stall.missing:
        collectives = stall.collectives.get(rank)
        what = f" [{collectives}]" if collectives else ""
        stack = stacks.get(rank) or "(not read: it was not in the call any more)\n"
        failures[rank] = (
            f"never reached the collective{what} the others waited in, "
            f"{snapshot.ranks[rank].where}; its Python stacks then:\n{stack}"
        )
    if stall.waiting:
        what = f"did not reach a collective that rank(s) {waiting} waited in"
    else:  # each waited in a collective another never entered
        what = "waited in different collectives, each missing from the others'"
    message = (
        f"Horovod job hung: rank(s) {missing} {what} for more than "
        f"stall_timeout_s={stall_timeout_s:g}s; the job was stopped.\n"
        + "\n".join(f"--- rank {r}: {t}" for r, t in failures.items())
    )
    return HangError(failures, message, stall.missing, stall.waiting)


# What horovod logs on a rank's stderr when its collectives stop on an error (operations.cc).
_BACKGROUND_ERROR = re.compile(r"Horovod background loop uncaught exception: (.*)")
# Gloo's words for a collective that waited ``timeout_s`` for a peer: the rank that timed
# out closes every pair with the first, and its own wait says the second. A peer whose
# pair it closed sees the third or fourth.
GLOO_TIMEOUT_TEXTS = ("Application timeout caused pair closure", "Timed out waiting")
GLOO_CLOSED_TEXTS = ("Connection closed by peer", "Connection reset by peer")
# Where a Gloo error starts in the line a collective raised: "[.../gloo/....cc:81] Timed...".
_GLOO_SOURCE = re.compile(r"\[[^\]\s]*gloo/[^\]]*\].*")


def background_error(stderr: str) -> str | None:
    """The last error that stopped horovod's collectives, from a rank's stderr."""
    found = _BACKGROUND_ERROR.findall(stderr)
    return found[-1].strip() if found else None


def _gloo_words(text: str) -> str | None:
    """The last line of ``text`` in Gloo's words for a timeout or a closed pair, from
    Gloo's source file on."""
    for line in reversed(text.splitlines()):
        if any(t in line for t in GLOO_TIMEOUT_TEXTS + GLOO_CLOSED_TEXTS):
            found = _GLOO_SOURCE.search(line)
            return (found[0] if found else line).strip()
    return None


def collectives_stopped(raised: str) -> bool:
    """Whether a rank's error says that horovod's collectives stopped under it: horovod's
    shut-down error, or Gloo's own error for the collective it was in."""
    return SHUT_DOWN_TEXT in raised or _gloo_words(raised) is not None


def gloo_timed_out(snapshot: Snapshot, stderr: Sequence[str], timeout_s: float) -> HangError | None:
    """The HangError for a job whose ranks all waited inside collectives for Gloo's
    timeout (a network that went silent without resetting a connection), or None.

    That is the case when no rank was lost, every rank raised, and each rank says that
    Gloo timed out or that a peer closed its connection, at least one the former. A rank
    says so in the error its collective raised, or, when it raised horovod's shut-down
    error, in its stderr (``stderr``, in rank order).
    """
    views = snapshot.ranks
    if len(stderr) != len(views) or any(v.seen in LOST or not v.raised for v in views):
        return None
    errors = []
    for view, text in zip(views, stderr, strict=True):
        error = _gloo_words(view.raised)
        if error is None and SHUT_DOWN_TEXT in view.raised:
            error = background_error(text)
        errors.append(error or "")
    timed_out = [any(t in e for t in GLOO_TIMEOUT_TEXTS) for e in errors]
    closed = [any(t in e for t in GLOO_CLOSED_TEXTS) for e in errors]
    if not any(timed_out) or not all(o or c for o, c in zip(timed_out, closed, strict=True)):
        return None
    ranks = tuple(range(len(views)))
    failures = {rank: f"waited {views[rank].where}; Gloo: {errors[rank]}" for rank in ranks}
    message = (
        f"Horovod job hung: every rank waited inside a collective for its peers' data for "
        f"timeout_s={timeout_s:g}s and none came, though every rank and node was alive: "
        f"the network Gloo uses stopped carrying data between nodes without resetting a "
        f"connection (a partition, a firewall, a failed link or switch port); the job was "
        f"stopped.\n" + "\n".join(f"--- rank {r}: {t}" for r, t in failures.items())
    )
    return HangError(failures, message, (), ranks)


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
