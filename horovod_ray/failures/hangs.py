"""A job that hung, for static jobs: pure functions, no Ray.

* horovod's stall inspector shut the job down (``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``):
  :func:`stall_report` reads its report from rank 0's stderr, :func:`stalled` says who was
  missing and who waited, :func:`hang_error` is the error the caller sees.
* Gloo's timeout ended every rank's collective (a network that went silent):
  :func:`gloo_timed_out`.

:func:`collectives_stopped` tells either apart from a rank's own error, for the probe.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping, Sequence

from horovod_ray.errors import HangError
from horovod_ray.failures.attribution import LOST, Snapshot

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
    missed: dict[int, set[str]] = {}
    last_shown: dict[int, str | None] = {}
    for rank, (_, text) in report.items():
        missed[rank], last_shown[rank] = _collectives(text)
    every = set().union(*missed.values())
    entered: set[str] = set()
    for rank in past:
        last = last_shown[rank]
        known = every if last is None else {name for name in every if name <= last}
        entered |= known - missed[rank]
    return set(past) | {r for r, names in missed.items() if names & entered}


def _collectives(text: str) -> tuple[set[str], str | None]:
    """The names in one line of the report and, when horovod shortened it ("a, b, c, d,
    e, f ..."), the last one shown: those after it are unknown. (A name of the user's
    own with ", " in it reads as two.)"""
    shown = text.removesuffix(" ...")
    names = [name for name in shown.split(", ") if name]
    return set(names), (names[-1] if names and shown != text else None)


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
