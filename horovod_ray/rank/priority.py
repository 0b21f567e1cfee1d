"""The ranks' CPU priority (niceness): what a node allows, the check, the rank's side.

Ray starts its workers at niceness 15 unless a node was started with
``RAY_worker_niceness=0``, so the ranks run behind every other process of their node;
horovodrun's ranks run at 0. ``create_settings(niceness=N)`` asks for N explicitly: each
rank reports the lowest niceness it may take (:func:`lowest_allowed`), the driver checks
it (:func:`check`: a static job before the rendezvous starts, an elastic job as each slot
starts), and each rank then sets it on all its threads (:func:`apply`). Without it, the
start only says once, at INFO, that the ranks run niced and how to start the nodes
instead (:func:`note`).

Linux keeps a niceness per thread, and a new thread takes its creator's: setting every
thread of the rank before user code runs covers the threads that TensorFlow, horovod and
Gloo start later.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Callable, Iterable

from horovod_ray.errors import ConfigError
from horovod_ray.rank.network import NodeFacts

logger = logging.getLogger(__name__)

# The lowest niceness Linux allows (settings accept 0 and up: a negative one would put the
# ranks ahead of Ray's own daemons, and their heartbeats, on the node).
LOWEST = -20
CAP_SYS_NICE = 23  # bits of the capability sets in /proc/<pid>/status
HINT = (
    "start Ray's nodes with their workers at normal priority: RAY_worker_niceness=0 "
    "ray start ... (a local Ray: ray.init(_system_config={'worker_niceness': 0}))"
)
# Whether this process has said that ranks run niced (once is enough).
_noted = False


def lowest_allowed(niceness: int, cap_sys_nice: bool, rlimit_nice: int) -> int:
    """The lowest niceness a process at ``niceness`` may give its threads.

    Raising it is always allowed; lowering it needs CAP_SYS_NICE (root has it), or goes
    down to ``20 - RLIMIT_NICE`` (``rlimit_nice`` is its soft limit; -1 is unlimited).

    >>> lowest_allowed(15, False, 0), lowest_allowed(15, False, 20), lowest_allowed(15, True, 0)
    (15, 0, -20)
    """
    if cap_sys_nice or rlimit_nice == resource.RLIM_INFINITY:
        return LOWEST
    return max(LOWEST, min(niceness, 20 - rlimit_nice))


def has_capability(status: str, bit: int) -> bool:
    """Whether a /proc/<pid>/status text grants capability ``bit`` (in its effective set)."""
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def own_lowest_allowed() -> int:
    """:func:`lowest_allowed` for this process."""
    try:
        with open("/proc/self/status") as status:
            cap = has_capability(status.read(), CAP_SYS_NICE)
    except OSError:
        cap = os.geteuid() == 0
    return lowest_allowed(os.nice(0), cap, resource.getrlimit(resource.RLIMIT_NICE)[0])


def check(niceness: int | None, nodes: Iterable[NodeFacts]) -> None:
    """Raises ConfigError if a rank may not take ``niceness``; for None, :func:`note`.

    Args:
        niceness: What the settings ask for; None keeps Ray's.
        nodes: Each rank's facts (its niceness and the lowest it may take).
    """
    nodes = list(nodes)
    if niceness is None:
        note(node.niceness for node in nodes)
        return
    refused = [node for node in nodes if niceness < node.lowest_niceness]
    if refused:
        first = refused[0]
        raise ConfigError(
            "niceness",
            f"niceness={niceness} is out of reach for {len(refused)} rank(s), the first "
            f"{first.where}: it runs at {first.niceness} and may go no lower than "
            f"{first.lowest_niceness} without CAP_SYS_NICE (or a higher RLIMIT_NICE); "
            f"{HINT}, or leave niceness=None",
        )


def note(nicenesses: Iterable[int]) -> None:
    """Says once per process, at INFO, when ranks run at a lowered priority, and the fix."""
    global _noted
    niced = sorted({niceness for niceness in nicenesses if niceness > 0})
    if niced and not _noted:
        _noted = True
        logger.info(
            "the ranks run at niceness %s (Ray's worker_niceness), behind every other "
            "process of their node; %s, or create_settings(niceness=0) where the ranks "
            "may raise their priority",
            ", ".join(map(str, niced)),
            HINT,
        )


def apply(
    niceness: int,
    setpriority: Callable[[int, int, int], None] = os.setpriority,
    list_threads: Callable[[], list[int]] | None = None,
) -> None:
    """Gives every thread of this process ``niceness`` (on the rank, before user code).

    Threads that start meanwhile (Ray's keep running) are listed again until none is new.

    Raises:
        ConfigError: The kernel refused it (a capability that does not hold outside a
            container's user namespace, say), with the fix.
    """
    list_threads = list_threads or _threads
    done: set[int] = set()
    while new := [tid for tid in list_threads() if tid not in done]:
        for tid in new:
            try:
                setpriority(os.PRIO_PROCESS, tid, niceness)
            except ProcessLookupError:
                pass  # a thread that ended meanwhile
            except PermissionError as err:
                raise ConfigError(
                    "niceness",
                    f"niceness={niceness} was refused on this rank ({err.strerror}) although "
                    f"it reports CAP_SYS_NICE or RLIMIT_NICE (a container's user namespace "
                    f"grants neither outside it); {HINT}, or leave niceness=None",
                ) from err
        done.update(new)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        return [0]  # no /proc: this thread only
