"""Looking at every rank of a failed call: the I/O half of ``attribution``.

A rank that loses a peer fails too, often before Ray reports the peer's death (Gloo sees
the closed socket first), and horovod may abort its process. So after a failure
:func:`probe` asks every rank for a sign of life (live ranks answer at once, even
mid-collective; dead ones fail the ping; ranks on a lost node stay silent), asks nodes
whose every rank died whether the node itself still runs, and returns a
:class:`~horovod_ray.failures.attribution.Snapshot` for
:func:`~horovod_ray.failures.attribution.attribute`.
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.errors import RankError, WorkerFailedError
from horovod_ray.failures.attribution import (
    RankView,
    Seen,
    Snapshot,
    wholly_lost_nodes,
)
from horovod_ray.failures.hangs import collectives_stopped

# After a failure, seconds a rank (or a node) gets to answer before it is taken as lost.
LIVENESS_TIMEOUT_S = 5.0
# After a rank is found lost, seconds before the others are asked again: a lost node's
# processes do not all die at the same instant.
LOST_RECHECK_S = 1.0
# After horovod shut a job down, longest wait for the ranks that waited to raise; the
# wait ends once none has for SETTLE_QUIET_S.
SETTLE_S = 1.0
SETTLE_QUIET_S = 0.1
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def unwrapped(err: BaseException) -> BaseException:
    """The :class:`RankError` a rank sent, out of Ray's wrapping; any other error as it is."""
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, RankError):
        return err.cause
    return err


def text_of(err: BaseException) -> str:
    """What a rank's error says: a :class:`RankError`'s traceback, else Ray's text."""
    return _ANSI.sub("", str(unwrapped(err)))  # Ray colours its traceback headers


def describe(err: BaseException, where: str) -> str:
    """One rank's failure as a message line: what happened, where, the original text."""
    text = text_of(err)
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


def get_all(refs: list[ray.ObjectRef], what: str, wheres: Sequence[str] = ()) -> list[Any]:
    """ray.get of every ref; WorkerFailedError naming each rank whose ref failed (and
    where it ran, given ``wheres`` in the refs' order)."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as first:
        failed = {}
        for index, ref in enumerate(refs):
            err = error_of(ref)
            if err is not None:
                where = describe(err, wheres[index]) if wheres else str(err)
                failed[index] = f"failed to {what}: {where}"
        raise WorkerFailedError(failed) from unwrapped(first)


def stacks(workers: Sequence[Any], ranks: Sequence[int], timeout_s: float) -> dict[int, str | None]:
    """The Python stacks of ``ranks`` now, asked on their control threads; None for a rank
    that gave none within ``timeout_s``."""
    refs = {rank: workers[rank].stacks.remote() for rank in ranks}
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    return {rank: ray.get(ref) if _ready(ref) else None for rank, ref in refs.items()}


def stacks_and_stderr(
    workers: Sequence[Any], ranks: Sequence[int], timeout_s: float
) -> tuple[dict[int, str], list[str]]:
    """The stacks of ``ranks`` that came, and every rank's stderr (where horovod writes
    its stall report, on rank 0, and why its collectives stopped; "" for a rank whose
    stderr did not come within ``timeout_s``)."""
    tails = [worker.stderr_tail.remote() for worker in workers]
    texts = stacks(workers, ranks, timeout_s)
    ray.wait(tails, num_returns=len(tails), timeout=timeout_s)
    return {r: t for r, t in texts.items() if t is not None}, [
        ray.get(tail) if _ready(tail) else "" for tail in tails
    ]


def _ready(ref: ray.ObjectRef) -> bool:
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready) and error_of(ref) is None


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
            raised[rank] = unwrapped(err)
    _ping(workers, wheres, refs, [r for r in range(n) if r not in seen], seen)
    if seen and len(seen) < n:
        time.sleep(LOST_RECHECK_S)
        _ping(workers, wheres, refs, [r for r in range(n) if r not in seen], seen)

    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
    views = []
    for rank in range(n):
        state, text = seen.get(rank, (Seen.ALIVE, ""))
        err = raised.get(rank)
        views.append(
            RankView(
                node_id=node_ids[rank],
                where=wheres[rank],
                raised=None if err is None else text_of(err),
                seen=state,
                lost_text=text,
                joined=None if joined is None else rank in joined,
                running=rank < len(refs) and refs[rank] not in done,
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


def settle_if_collectives_stopped(refs: list[ray.ObjectRef]) -> bool:
    """Whether a rank failed because horovod's collectives stopped (its shut-down error, or
    Gloo's); if one did, the others that waited raise within moments: waits up to
    SETTLE_S for them."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    if not any(collectives_stopped(str(error_of(ref))) for ref in ready):
        return False
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:  # until no more rank raises for a moment
        now, _ = ray.wait(refs, num_returns=len(refs), timeout=SETTLE_QUIET_S)
        if len(now) == len(ready):
            break
        ready = now
    return True
