"""horovod.ray's ``TestDiscovery``: a discovery's hosts (Ray's nodes by default) hidden
and shown again on a timer, the chaos that exercises an elastic job.

Each change is decided in :func:`next_change`, pure but for a seeded random number
generator, so that one seed replays one schedule. Only a forceful change does more than
leave a host out of the answer: it kills the node's ranks (:func:`_kill_ranks_on`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import signal
import threading
import time
from typing import Callable, Collection, Mapping

import ray
from horovod.runner.elastic.discovery import HostDiscovery
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.discovery.ray_nodes import RayHostDiscovery
from horovod_ray.errors import ConfigError
from horovod_ray.job.placement import nodes_named
from horovod_ray.settings import is_int, require_positive, require_seconds

logger = logging.getLogger(__name__)

# Longest a forceful change waits for its kill: it runs in horovod's discovery thread,
# which sees no other change of hosts meanwhile.
KILL_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class HostChange:
    """One change a :class:`TestDiscovery` made.

    Attributes:
        at_s: The discovery's clock when it was made (``time.monotonic()`` by default).
        host: The host hidden, or shown again.
        hidden: True: hidden; False: shown again.
        num_offered: How many hosts the discovery offered after it.
        num_killed: The ranks a forceful change killed on the host's node (0 otherwise).
    """

    at_s: float
    host: str
    hidden: bool
    num_offered: int
    num_killed: int = 0


def next_change(
    offered: Collection[str],
    hidden: Collection[str],
    min_hosts: int,
    max_hosts: int,
    rng: random.Random,
) -> tuple[str, bool] | None:
    """The next change of a :class:`TestDiscovery`'s schedule: a host to hide, or one to
    show again. Pure, but for what it draws from ``rng``.

    With ``min_hosts`` or fewer offered, a hidden host is shown again; with ``max_hosts``
    or more, an offered one is hidden; in between, a fair coin decides. So a schedule that
    starts within the bounds stays there, one host at a time. The host is drawn from a
    sorted list: a set's order differs from one process to the next, a seed's draws do not.

    With ``min_hosts=2`` and ``max_hosts=3``, where the coin never decides::

        offered a, b, c   hidden -   -> hide one of a, b, c
        offered a, c      hidden b   -> (b, False): show b
        offered a         hidden -   -> None: nothing to show

    Args:
        offered: The hosts offered now.
        hidden: The hidden hosts that the underlying discovery still lists.
        min_hosts: At or below this many offered, show a host.
        max_hosts: At or above this many offered, hide one.
        rng: The schedule's random number generator.

    Returns:
        ``(host, True)`` to hide the host, ``(host, False)`` to show it again, or None
        when the move due has no host to take (none hidden to show, none offered to hide).
    """
    if len(offered) <= min_hosts:
        hide = False
    elif len(offered) >= max_hosts:
        hide = True
    else:
        hide = rng.random() < 0.5
    pool = sorted(offered if hide else hidden)
    if not pool:
        return None
    return rng.choice(pool), hide


class TestDiscovery(HostDiscovery):
    """horovod.ray's ``TestDiscovery``: the hosts of a discovery (Ray's nodes, as
    :class:`RayHostDiscovery` finds them, by default), one of them hidden or shown again
    every ``change_frequency_s``, so that an elastic job shrinks and grows as it trains.
    A host is hidden only while more than ``min_hosts`` are offered, and one is always
    hidden while ``max_hosts`` or more are (see :func:`next_change`)::

        settings = ElasticRayExecutor.create_settings(min_num_proc=2)
        settings.discovery = TestDiscovery(min_hosts=2, max_hosts=4, change_frequency_s=20)
        executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)

    or ``RayExecutor(settings, min_workers=2, override_discovery=TestDiscovery(...))``.

    The job asks about once a second. The first call starts the timer; a call
    ``change_frequency_s`` or more after the last change (or the start) makes the next
    one, at most one per call, and restarts the timer. What the call returns leaves the
    hidden hosts out, and horovod's elastic driver sees each go:

    * graceful (the default): nothing else is done. The driver tells the ranks at their
      next ``state.commit()`` or ``state.check_host_updates()``; the hidden host's ranks
      leave and the others go on from there, as when Ray drains a node.
    * forceful (``_graceful=False``): before the call returns, the job's own ranks on the
      host's node (the elastic job that uses it names them: :meth:`bind_ranks`) are
      killed (SIGKILL, as in a crash); without a job, nothing is. The others then
      fail in a collective and go back to their last commit, and horovod's driver keeps
      the host out as a failed one (for good, or for the job's ``cooldown_range``), even
      once it is shown again. A kill that fails is logged; the host stays hidden.

    A host shown again is offered to the job, which grows onto it. A hidden host that the
    underlying discovery stops listing is forgotten (offered if it comes back).

    Args:
        min_hosts: Hide a host only while more than this many are offered.
        max_hosts: Hide one whenever this many or more are offered.
        change_frequency_s: Seconds between changes.
        use_gpu: As :class:`RayHostDiscovery`'s, for the default discovery.
        cpus_per_slot: As :class:`RayHostDiscovery`'s, for the default discovery.
        gpus_per_slot: As :class:`RayHostDiscovery`'s, for the default discovery.
        verbose: Log each change at INFO (False: at DEBUG).
        _graceful: True: hide a host; False: hide it and kill its ranks (horovod's name).
        seed: Seeds the schedule's draws: one seed, one schedule, given the same hosts at
            the same calls (None: a different schedule each time).
        discovery: The horovod ``HostDiscovery`` whose hosts come and go, instead of
            Ray's nodes; its hosts name Ray nodes (address, host name or node id).
        clock: Seconds, for the timer (tests give their own).

    Raises:
        ConfigError: A bad argument, naming it, before anything is asked of Ray.
    """

    # pytest would take a class named Test* in a test module for a suite of tests.
    __test__ = False

    def __init__(
        self,
        min_hosts: int,
        max_hosts: int,
        change_frequency_s: float,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float = 1,
        verbose: bool = True,
        _graceful: bool = True,
        *,
        seed: int | None = None,
        discovery: HostDiscovery | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        _check_bounds(min_hosts, max_hosts)
        require_seconds("change_frequency_s", change_frequency_s)
        for name, flag in (("use_gpu", use_gpu), ("verbose", verbose), ("_graceful", _graceful)):
            if not isinstance(flag, bool):
                raise ConfigError(name, f"{name} must be True or False, got {flag!r}")
        require_positive("cpus_per_slot", cpus_per_slot)
        require_positive("gpus_per_slot", gpus_per_slot)
        if seed is not None and not is_int(seed):
            raise ConfigError(
                "seed", f"seed must be an int (or None for a new schedule each time), got {seed!r}"
            )
        if not callable(clock):
            raise ConfigError("clock", f"clock must be a function returning seconds, got {clock!r}")
        self._hosts = _underlying(discovery, use_gpu, cpus_per_slot, gpus_per_slot)
        self._min_hosts, self._max_hosts = min_hosts, max_hosts
        self._change_frequency_s = change_frequency_s
        self._graceful = _graceful
        self._level = logging.INFO if verbose else logging.DEBUG
        self._rng = random.Random(seed)
        self._clock = clock
        # horovod's driver asks from one thread; the lock keeps a caller of its own safe.
        self._lock = threading.Lock()
        self._hidden: set[str] = set()
        self._changes: list[HostChange] = []
        self._timer_from_s: float | None = None
        # The ids of the job's own rank actors (hex), from the job that runs with this
        # discovery (bind_ranks): a forceful change kills only those.
        self._ranks: Callable[[], set[str]] | None = None

    def bind_ranks(self, ranks: Callable[[], set[str]]) -> None:
        """Called by the elastic job that uses this discovery, as it starts: ``ranks()``
        gives the ids of its rank actors alive now, the only ones a forceful change
        kills (another job's, a concurrent Tune trial's, are never touched)."""
        with self._lock:
            self._ranks = ranks

    @property
    def hidden(self) -> frozenset[str]:
        """The hosts hidden now."""
        with self._lock:
            return frozenset(self._hidden)

    @property
    def changes(self) -> tuple[HostChange, ...]:
        """Every change made so far, the oldest first."""
        with self._lock:
            return tuple(self._changes)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        """The underlying discovery's hosts and slots less the hidden hosts, after the
        schedule's next change if it is due.

        Returns:
            Host -> slots, as horovod's elastic driver takes them.
        """
        now = self._clock()
        hosts = dict(self._hosts.find_available_hosts_and_slots())
        with self._lock:
            self._hidden &= hosts.keys()
            if self._timer_from_s is None:
                self._timer_from_s = now
            elif now - self._timer_from_s >= self._change_frequency_s:
                self._timer_from_s = now
                self._change(hosts, now)
            return {host: slots for host, slots in hosts.items() if host not in self._hidden}

    def _change(self, hosts: Mapping[str, int], now: float) -> None:
        """Makes the schedule's next change (under the lock)."""
        offered = [host for host in hosts if host not in self._hidden]
        change = next_change(offered, self._hidden, self._min_hosts, self._max_hosts, self._rng)
        if change is None:
            logger.debug("TestDiscovery: no host to change (%d offered)", len(offered))
            return
        host, hide = change
        killed = 0
        if hide:
            self._hidden.add(host)
            if not self._graceful:
                killed = _kill_ranks_on(host, self._ranks)
        else:
            self._hidden.discard(host)
        record = HostChange(now, host, hide, len(hosts) - len(self._hidden), killed)
        self._changes.append(record)
        logger.log(
            self._level,
            "TestDiscovery: %s host %s%s; %d of %d hosts offered",
            "hid" if hide else "showed again",
            host,
            f" and killed its {killed} rank(s)" if killed else "",
            record.num_offered,
            len(hosts),
        )


def _check_bounds(min_hosts: object, max_hosts: object) -> None:
    require_positive("min_hosts", min_hosts, integer=True)
    require_positive("max_hosts", max_hosts, integer=True)
    if max_hosts < min_hosts:
        raise ConfigError(
            "max_hosts",
            f"max_hosts={max_hosts} is below min_hosts={min_hosts}: give max_hosts >= min_hosts",
        )


def _underlying(
    discovery: object, use_gpu: bool, cpus_per_slot: float, gpus_per_slot: float
) -> HostDiscovery:
    """The discovery whose hosts come and go: the user's, or Ray's nodes."""
    if discovery is None:
        return RayHostDiscovery(use_gpu, cpus_per_slot, gpus_per_slot)
    if not callable(getattr(discovery, "find_available_hosts_and_slots", None)):
        raise ConfigError(
            "discovery",
            f"discovery must be a horovod HostDiscovery (find_available_hosts_and_slots()), "
            f"got {type(discovery).__name__}",
        )
    if (use_gpu, cpus_per_slot, gpus_per_slot) != (False, 1, 1):
        raise ConfigError(
            "discovery",
            "use_gpu, cpus_per_slot and gpus_per_slot shape the default discovery (Ray's "
            "nodes); with discovery=..., leave them out and count the slots there",
        )
    return discovery


def _kill_ranks_on(host: str, ranks: Callable[[], set[str]] | None) -> int:
    """Kills (SIGKILL) the job's ranks (``ranks()``: their actor ids) on ``host``'s Ray
    node; how many. None: no job bound this discovery, nothing is killed.

    Never raises: it runs in horovod's discovery thread, which a raise would end without
    a word, and with it every later change of hosts. A failure is logged instead.
    """
    if ranks is None:
        logger.warning("TestDiscovery: no job runs with it; host %s hidden, nothing killed", host)
        return 0
    try:
        context = ray.get_runtime_context()
        nodes = nodes_named(host, ray.nodes(), context.get_node_id())
        own = ranks()
        if len(nodes) != 1:
            logger.warning("TestDiscovery: host %s is no single Ray node: nothing killed", host)
            return 0
        # The GCS's actor table, not Ray's state API, which needs the dashboard (a
        # local Ray that run() starts has none).
        from ray._private import state

        pids = sorted(
            actor["Pid"]
            for actor in state.actors().values()
            if actor.get("State") == "ALIVE"
            and actor.get("ActorID") in own
            and (actor.get("Address") or {}).get("NodeID") == nodes[0]
            and actor.get("Pid")
        )
        if pids:
            # Run on that node: a pid means something only on its own machine.
            strategy = NodeAffinitySchedulingStrategy(nodes[0], soft=False)
            killing = _kill.options(scheduling_strategy=strategy).remote(pids)
            ray.get(killing, timeout=KILL_TIMEOUT_S)
        return len(pids)
    except Exception:  # noqa: BLE001 - see above
        logger.warning(
            "TestDiscovery: the ranks on host %s could not be killed; it is hidden all the same",
            host,
            exc_info=True,
        )
        return 0


@ray.remote(num_cpus=0)
def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.kill(pid, signal.SIGKILL)
