"""Elastic jobs: horovod's own elastic driver, with Ray placing one actor per rank.

horovod's :class:`~horovod.runner.elastic.driver.ElasticDriver` decides the world: it asks
a discovery object which hosts have how many slots, assigns ranks, and after a failure or
a change of hosts lets the survivors roll back to their last commit (``hvd.elastic.run``)
and go on. Here a host is a Ray node (keyed by node id, as static jobs set
``HOROVOD_HOSTNAME``), :class:`NodeDiscovery` reads Ray's node table, and each slot the
driver starts becomes one :class:`~horovod_ray.worker.Worker` actor pinned to its node
(:meth:`ElasticRun.run_slot`). The rendezvous is this package's locked-down server with
horovod's elastic store mixed in, and lets each new node's address in as it joins.

While the world is below ``max_workers``, the job asks Ray's autoscaler for the missing
ranks' resources (``request_resources``) and withdraws the request when it ends.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import ray
from horovod.runner.common.util import codec
from horovod.runner.common.util import timeout as horovod_timeout
from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.driver import ElasticDriver
from horovod.runner.elastic.rendezvous import GET_RANK_AND_SIZE, PUT_WORKER_ADDRESSES
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray import logs, network
from horovod_ray.errors import ElasticLimitError, HorovodRayError, WorkerFailedError
from horovod_ray.failures import describe
from horovod_ray.rendezvous import RendezvousServer, worker_env
from horovod_ray.settings import ElasticLayout, Settings, WorkerLayout
from horovod_ray.worker import RemoteWorker

logger = logging.getLogger(__name__)

# How often a slot's thread checks whether the driver wants its worker gone.
SLOT_POLL_S = 0.1
# Longest a stopped run waits for horovod's driver thread to wind down.
STOP_JOIN_S = 10.0
_RESET_LIMIT_TEXT = "number of resets during elastic job exceeded limit"


# ------------------------------------------------------------------ discovery (pure part)


def node_slots(
    nodes: Iterable[Mapping[str, Any]],
    per_worker: Mapping[str, float],
    only_ip: str | None = None,
) -> dict[str, int]:
    """Slots per alive node (``ray.nodes()`` entries): how many ranks its resources hold.

    Args:
        nodes: Ray's node table.
        per_worker: The resources one rank reserves.
        only_ip: Count only nodes with this address (a job kept on the driver's machine).

    Returns:
        Node id -> slots, for nodes with at least one.
    """
    slots = {}
    for node in nodes:
        if not node.get("Alive") or (only_ip and node.get("NodeManagerAddress") != only_ip):
            continue
        resources = node.get("Resources", {})
        fits = min(int(resources.get(name, 0) // amount) for name, amount in per_worker.items())
        if fits > 0:
            slots[node["NodeID"]] = fits
    return slots


def membership_change(
    before: Sequence[SlotInfo], after: Sequence[SlotInfo], reset: int
) -> dict[str, Any]:
    """What changed between two worlds, as the dict the callbacks get.

    A slot is a (node, local rank) pair: ``ranks_removed`` are the old world's ranks of
    slots that are gone, ``ranks_added`` the new world's ranks of slots that are new.
    """
    old = {(slot.hostname, slot.local_rank): slot.rank for slot in before}
    new = {(slot.hostname, slot.local_rank): slot.rank for slot in after}
    nodes_before = {host for host, _ in old}
    nodes_after = {host for host, _ in new}
    return {
        "event": "membership",
        "reset": reset,
        "size_before": len(before),
        "size_after": len(after),
        "nodes_added": sorted(nodes_after - nodes_before),
        "nodes_removed": sorted(nodes_before - nodes_after),
        "ranks_added": sorted(rank for slot, rank in new.items() if slot not in old),
        "ranks_removed": sorted(rank for slot, rank in old.items() if slot not in new),
    }


class NodeDiscovery(HostDiscovery):
    """horovod's host discovery over Ray's node table, read at most every ``interval_s``."""

    def __init__(
        self, per_worker: Mapping[str, float], only_ip: str | None, interval_s: float
    ) -> None:
        super().__init__()
        self._per_worker = dict(per_worker)
        self._only_ip = only_ip
        self._interval_s = interval_s
        self._last: tuple[float, dict[str, int]] = (-float("inf"), {})

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        read_at, slots = self._last
        if time.monotonic() - read_at >= self._interval_s:
            slots = node_slots(ray.nodes(), self._per_worker, self._only_ip)
            self._last = (time.monotonic(), slots)
        return dict(slots)


class _Driver(ElasticDriver):
    """horovod's driver, remembering why it gave up, and able to stop at once.

    horovod's registry catches what ``resume()`` raises (too few slots for too long, no
    host of the last world left) and stops without a message; this keeps the reason.
    """

    timed_out_waiting = False
    gave_up: str | None = None

    def wait_for_available_slots(self, min_num_proc, min_hosts=1):
        try:
            return super().wait_for_available_slots(min_num_proc, min_hosts)
        except horovod_timeout.TimeoutException:
            self.timed_out_waiting = True
            raise

    def resume(self):
        try:
            super().resume()
        except Exception as err:
            self.gave_up = str(err)
            raise

    def available_slots(self) -> int:
        """Slots on the hosts horovod still counts (failed hosts are left out)."""
        return self._host_manager.current_hosts.count_available_slots()

    def stop_now(self) -> None:
        """Stops, and wakes whatever waits inside the driver (a wait for slots, ranks
        waiting at the reset barrier), so that no thread outlives the run."""
        if not self.finished():
            self.stop()
        with self._wait_hosts_cond:
            self._wait_hosts_cond.notify_all()
        barrier = self._worker_registry._barrier  # None before the first world
        if barrier is not None:
            barrier.abort()


class _Store:
    """The rendezvous as horovod's driver sees it: ``init(plan)`` per world, ``stop()``."""

    def __init__(self, on_world: Callable[[list[SlotInfo]], None]) -> None:
        self._on_world = on_world
        # Set once the server exists: the server's store needs the driver, which needs this.
        self.server: RendezvousServer | None = None

    def init(self, host_alloc_plan: list[SlotInfo]) -> None:
        self.server.init(host_alloc_plan)
        self._on_world(list(host_alloc_plan))

    def stop(self) -> None:
        # The driver calls this more than once; the server's own stop() waits for the end.
        pass


class _DriverHooks:
    """The two scopes horovod's elastic driver answers itself in the rendezvous store.

    A reset rank GETs ``rank_and_size/<host>:<slot>``: the driver records it ready
    (blocking on its barrier until the world's ranks all have) and answers its new
    ranks. A rank PUTs its notification server's addresses to ``worker_addresses``.
    """

    scopes = frozenset({GET_RANK_AND_SIZE, PUT_WORKER_ADDRESSES})

    def __init__(self, driver: ElasticDriver) -> None:
        self._driver = driver

    def get(self, scope: str, key: str) -> bytes | None:
        if scope != GET_RANK_AND_SIZE:
            return None
        host, slot = _host_slot(key)
        self._driver.record_ready(host, slot)
        return self._driver.get_slot_info(host, slot).to_response_string().encode("ascii")

    def put(self, scope: str, key: str, value: bytes) -> None:
        if scope == PUT_WORKER_ADDRESSES:
            host, slot = _host_slot(key)
            addresses, secret_key = codec.loads_base64(value)
            self._driver.register_worker_server(host, slot, addresses, secret_key)


def _host_slot(key: str) -> tuple[str, int]:
    host, _, slot = key.rpartition(":")
    return host, int(slot)


@dataclasses.dataclass
class _Outcome:
    """What one run gathered from its slots' threads."""

    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    failures: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    worlds: list[list[SlotInfo]] = dataclasses.field(default_factory=list)


class ElasticRun:
    """One elastic ``run()``: driver, rendezvous, discovery and the slots' workers.

    Args:
        settings: Timeouts, interfaces, verbosity.
        layout: The elastic bounds and limits.
        worker: What one rank reserves (the executor's layout).
        extra_env: More environment variables for every rank.
        executable: ``executable_cls`` pickled with its arguments, or None.
    """

    def __init__(
        self,
        settings: Settings,
        layout: ElasticLayout,
        worker: WorkerLayout,
        extra_env: Mapping[str, str],
        executable: bytes | None,
    ) -> None:
        self._settings = settings
        self._layout = layout
        self._worker = worker
        self._extra_env = dict(extra_env)
        self._executable = executable
        self._lock = threading.Lock()
        self._actors: dict[int, Any] = {}  # by the id of the slot thread's call
        self._outcome = _Outcome()
        self._events: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._driver: _Driver | None = None
        self._server: RendezvousServer | None = None
        self._call: tuple[ray.ObjectRef, bytes | None] | None = None
        self._local_only = True
        self._common_env: dict[str, str] = {}
        # Set once run() has released everything (stop() may wait for it).
        self.ended = threading.Event()

    # ------------------------------------------------------------------------ driver

    def run(self, fn: bytes, args: bytes | None, callbacks: list[Callable[[dict], None]]):
        """Runs the call elastically to its end; the final world's results in rank order.

        Raises:
            ElasticLimitError: Below ``min_workers`` for ``elastic_timeout``, or more than
                ``reset_limit`` resets.
            WorkerFailedError: The job failed otherwise (every host failed, ...).
            HorovodRayError: stop() ended the run.
        """
        layout = self._layout
        driver_ip = ray.util.get_node_ip_address()
        nodes = ray.nodes()
        # Loopback when every node with room for a rank is on the driver's machine (a
        # local Ray, simulated nodes), so that nothing leaves it; such a job stays there.
        # Otherwise (other machines, or none with room yet, as on an autoscaling cluster
        # with a 0-CPU head) the driver's address, and each node's own interface.
        per_rank = self._worker.worker_resources()
        with_room = node_slots(nodes, per_rank)
        addresses = {n["NodeManagerAddress"] for n in nodes if n["NodeID"] in with_room}
        self._local_only = addresses == {driver_ip}
        bind = "127.0.0.1" if self._local_only else driver_ip
        discovery = NodeDiscovery(
            per_rank,
            driver_ip if self._local_only else None,
            layout.discovery_interval_s,
        )
        self._call = (ray.put(fn), args)
        autoscaler = _AutoscalerRequest(layout, per_rank)
        result: dict[str, Any] = {}
        try:
            with self._lock:
                if self._stopping.is_set():
                    raise HorovodRayError("the elastic run was ended by stop()")
                store = _Store(self._on_world)
                self._driver = driver = _Driver(
                    store,
                    discovery,
                    min_num_proc=layout.min_workers,
                    max_num_proc=layout.max_workers,
                    timeout=layout.elastic_timeout_s,
                    reset_limit=layout.reset_limit,
                    cooldown_range=layout.cooldown_range,
                    verbose=self._settings.verbose >= 2,
                )
                self._server = server = RendezvousServer(
                    bind, [bind], self._settings.verbose, hooks=_DriverHooks(driver)
                )
                store.server = server
                server.start([])
            self._common_env = {
                **worker_env(server),
                "HOROVOD_CONTROLLER": "gloo",
                "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_TIMEOUT_SECONDS": str(math.ceil(self._settings.timeout_s)),
                "HOROVOD_ELASTIC": "1",
            }
            autoscaler.ask()
            finished = threading.Event()

            def drive() -> None:
                try:
                    driver.start(layout.min_workers, self.run_slot)
                    result["results"] = driver.get_results()
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    result["error"] = err
                finally:
                    finished.set()

            thread = threading.Thread(target=drive, name="horovod_ray-elastic", daemon=True)
            thread.start()
            while not finished.wait(0.1) and not self._stopping.is_set():
                self._deliver(callbacks)
            self._deliver(callbacks)
            stopped_early = self._stopping.is_set()
            if stopped_early:
                self.stop()
                thread.join(STOP_JOIN_S)
        finally:
            self.stop()
            autoscaler.withdraw()
            self.ended.set()
        if stopped_early:
            raise HorovodRayError("the elastic run was ended by stop()")
        return self._conclude(result)

    def _deliver(self, callbacks: list[Callable[[dict], None]]) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if event.get("event") == "membership":
                logger.info("elastic job: %s", event)
            for callback in callbacks:
                callback(event)

    def _on_world(self, plan: list[SlotInfo]) -> None:
        with self._lock:
            before = self._outcome.worlds[-1] if self._outcome.worlds else []
            self._outcome.worlds.append(plan)
            resets = len(self._outcome.worlds) - 1
        self._events.put(membership_change(before, plan, resets))

    def _conclude(self, result: dict[str, Any]) -> list[Any]:
        layout, driver = self._layout, self._driver
        available = min(driver.available_slots(), layout.max_workers or sys.maxsize)
        error = result.get("error")
        # Set by every wait for slots that timed out: at start, or inside a reset.
        if driver.timed_out_waiting:
            raise ElasticLimitError(
                "min_workers",
                layout.min_workers,
                available,
                f"elastic job stopped: fewer than min_workers={layout.min_workers} ranks "
                f"could be placed for elastic_timeout={layout.elastic_timeout_s:g}s "
                f"(wanted {layout.min_workers}, the cluster could hold {available}); "
                f"add capacity or lower min_workers",
            )
        if error is not None:
            raise HorovodRayError(f"elastic job failed: {error}") from error
        results = result["results"]
        message = results.error_message or driver.gave_up or ""
        if _RESET_LIMIT_TEXT in message:
            raise ElasticLimitError(
                "reset_limit",
                layout.min_workers,
                available,
                f"elastic job stopped: more than reset_limit={layout.reset_limit} resets "
                f"(wanted at least {layout.min_workers} ranks, the cluster could hold "
                f"{available}); resets for growth count too",
            )
        final = self._outcome.worlds[-1] if self._outcome.worlds else []
        failed = any(code != 0 for code, _ in results.worker_results.values())
        if message or failed or len(self._outcome.results) != len(final):
            # The last world's failures; earlier ones were recovered from (and logged).
            last = len(self._outcome.worlds) - 1
            failures = {
                rank: text
                for (reset, rank), text in self._outcome.failures.items()
                if reset == last
            }
            if message:
                failures.setdefault(-1, f"horovod's elastic driver gave up: {message}")
            raise WorkerFailedError(failures or {-1: "the job ended without every result"})
        return [self._outcome.results[rank] for rank in sorted(self._outcome.results)]

    def stop(self) -> None:
        """Ends the driver, every worker and the rendezvous. Safe to call more than once,
        from any thread; ``run()`` then raises in its own."""
        with self._lock:
            self._stopping.set()
            driver, server = self._driver, self._server
            actors = list(self._actors.values())
            self._actors.clear()
        if driver is not None:
            driver.stop_now()
        for actor in actors:
            _kill(actor)
        if server is not None:
            server.stop()

    # ------------------------------------------------------------------------ slots

    def run_slot(self, slot: SlotInfo, events: Sequence[threading.Event]) -> tuple[int, float]:
        """One rank from start to exit (horovod's driver calls it, in its own thread).

        Never raises: horovod counts the return value, ``(exit code, time)``.
        """
        key = threading.get_ident()
        actor = None
        where = f"on node {slot.hostname[:12]}, local rank {slot.local_rank}"
        start_s = self._settings.placement_group_timeout_s
        try:
            actor = RemoteWorker.options(
                num_cpus=self._worker.cpus_per_worker,
                num_gpus=self._worker.gpus,
                scheduling_strategy=NodeAffinitySchedulingStrategy(slot.hostname, soft=False),
            ).remote()
            with self._lock:
                if self._stopping.is_set():
                    raise _ReleasedError()
                self._actors[key] = actor
            facts = self._wait(actor.node_info.remote(), events, start_s)
            where = f"{facts.where}, local rank {slot.local_rank}"
            iface = network.gloo_iface(facts, self._settings.nics, self._local_only)
            self._server.allow(facts.node_ip)
            env = {
                **self._common_env,
                **_slot_env(slot),
                "HOROVOD_GLOO_IFACE": iface,
                **self._extra_env,
            }
            self._wait(actor.setup.remote(env, False, self._executable), events, start_s)
            fn_ref, args = self._call
            value = self._wait_call(actor, actor.call.remote(1, None, fn_ref, args), events)
            # The rank the driver gives this slot in the world that finished.
            rank = self._driver.get_slot_info(slot.hostname, slot.local_rank).rank
            with self._lock:
                self._outcome.results[rank] = value
            return 0, time.time()
        except _ReleasedError:
            logger.info("elastic job: the rank %s was let go", where)
            return 1, time.time()
        except Exception as err:  # noqa: BLE001 - horovod counts the exit code
            with self._lock:
                reset = len(self._outcome.worlds) - 1
                self._outcome.failures[reset, slot.rank] = describe(err, where)
            logger.warning("elastic job: rank %d %s ended: %s", slot.rank, where, err)
            return 1, time.time()
        finally:
            with self._lock:
                self._actors.pop(key, None)
            if actor is not None:
                _kill(actor)

    def _wait_call(self, actor: Any, ref: ray.ObjectRef, events: Sequence[threading.Event]):
        """Waits for the user's call, passing on what the rank logs while it is rank 0."""
        poll: ray.ObjectRef | None = actor.next_logs.remote(1, logs.LOG_POLL_S)
        while True:
            waiting = [ref] if poll is None else [ref, poll]
            ready, _ = ray.wait(waiting, num_returns=1, timeout=SLOT_POLL_S)
            if poll is not None and poll in ready:
                items, finished = ray.get(poll)
                for item in items:
                    self._events.put(item)
                poll = None if finished else actor.next_logs.remote(1, logs.LOG_POLL_S)
            if ref in ready:
                value = ray.get(ref)
                for item in logs.remaining(actor, poll, 1):
                    self._events.put(item)
                return value
            if self._stopping.is_set() or any(event.is_set() for event in events):
                raise _ReleasedError()

    def _wait(
        self, ref: ray.ObjectRef, events: Sequence[threading.Event], timeout_s: float | None
    ) -> Any:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            ready, _ = ray.wait([ref], timeout=SLOT_POLL_S)
            if ready:
                return ray.get(ref)
            if self._stopping.is_set() or any(event.is_set() for event in events):
                raise _ReleasedError()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the worker within {timeout_s:g}s")


class _ReleasedError(Exception):
    """The driver or stop() let this slot's worker go."""


def _slot_env(slot: SlotInfo) -> dict[str, str]:
    return {
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_RANK": str(slot.rank),
        "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank),
        "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank),
        "HOROVOD_CROSS_SIZE": str(slot.cross_size),
    }


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone is fine
        logger.debug("kill of an elastic worker failed", exc_info=True)


class _AutoscalerRequest:
    """Asks Ray's autoscaler for room for ``max_workers`` ranks; withdrawn at the end.

    ``request_resources`` is one standing request for the cluster's total size (each call
    replaces the last), so it covers the ranks already running and the missing ones.
    Without ``max_workers``, it asks for ``min_workers``.
    """

    def __init__(self, layout: ElasticLayout, per_rank: dict[str, float]) -> None:
        wanted = layout.max_workers or layout.min_workers
        self._bundles = [per_rank] * wanted
        self._asked = False

    def ask(self) -> None:
        from ray.autoscaler.sdk import request_resources

        try:
            request_resources(bundles=self._bundles)
            self._asked = True
        except Exception:  # noqa: BLE001 - a hint; the job runs on what there is
            logger.warning("could not ask the autoscaler for room", exc_info=True)

    def withdraw(self) -> None:
        if not self._asked:
            return
        from ray.autoscaler.sdk import request_resources

        try:
            request_resources(bundles=[])
        except Exception:  # noqa: BLE001 - Ray already gone
            logger.debug("withdrawing the autoscaler request failed", exc_info=True)
        self._asked = False
