"""One elastic ``run()``: horovod's elastic driver, the rendezvous, discovery, the slots.

horovod's driver (``elastic_driver``) asks ``discovery.NodeDiscovery`` which Ray nodes
have how many slots, numbers the ranks, and starts each slot through
:meth:`ElasticRun.run_slot`, which walks the same bring-up path as a static job's ranks
(``bringup``): an actor pinned to the slot's node, its node facts, its interface, its
environment, its setup. After a failure or a change of nodes the driver lets the
survivors roll back to their last commit (``hvd.elastic.run``) and go on: horovod's
driver decides a node is lost, ``attribution.elastic_error`` how the run ended. Ray's
autoscaler is asked for room for ``max_workers`` ranks (``demand``: beside other jobs'),
except by a job kept on the driver's machine, which could use none of the nodes it launches.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import ray
from horovod.runner.common.util.hosts import SlotInfo
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from horovod_ray.errors import HorovodRayError
from horovod_ray.failures import attribution, probe
from horovod_ray.job import bringup, draining, elastic_driver
from horovod_ray.job.demand import AutoscalerRequest
from horovod_ray.job.discovery import NodeDiscovery, addresses_with_room, staying
from horovod_ray.job.layouts import ElasticLayout, WorkerLayout
from horovod_ray.job.lifecycle import RUN_TRANSITIONS, Lifecycle, RunState
from horovod_ray.rank import logs, network, priority
from horovod_ray.rank.assignment import RankInfo, membership_change
from horovod_ray.rank.network import NodeFacts
from horovod_ray.rendezvous.server import RendezvousServer
from horovod_ray.settings import Settings

logger = logging.getLogger(__name__)

STOP_JOIN_S = 10.0  # longest a stopped run waits for horovod's driver thread to end
DELIVER_S = 0.1  # how often the run's own thread hands rank 0's dicts to the callbacks
REMOVED_FROM_JOB = "has been removed from elastic job"  # horovod's refusal of a left host's rank


@dataclasses.dataclass
class _Outcome:
    """What one run gathered from its slots' threads."""

    results: dict[int, Any] = dataclasses.field(default_factory=dict)
    failures: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)
    worlds: list[list[RankInfo]] = dataclasses.field(default_factory=list)


class _ReleasedError(Exception):
    """The driver or stop() let this slot's worker go."""


class ElasticRun:
    """One elastic ``run()``: driver, rendezvous, discovery and the slots' workers.

    Args:
        settings: Timeouts, interfaces, verbosity.
        layout: The elastic bounds and limits.
        worker: What one rank reserves.
        extra_env: The ranks' extra environment (``start(extra_env_vars=...)``).
        executable: The pickled ``executable_cls`` and its arguments, or None.
        on_world: Called with (size, resets) each time the world forms or changes.
        datasets: The ranks' iterators over the job's datasets, or None.
    """

    def __init__(
        self,
        settings: Settings,
        layout: ElasticLayout,
        worker: WorkerLayout,
        extra_env: Mapping[str, str],
        executable: bytes | None,
        on_world: Callable[[int, int], None] | None = None,
        datasets: dict[str, Any] | None = None,
    ) -> None:
        self._settings, self._layout, self._worker = settings, layout, worker
        self._datasets = datasets
        self._world_hook = on_world
        self._extra_env, self._executable = dict(extra_env), executable
        self._state = Lifecycle(RUN_TRANSITIONS, RunState.CREATED)
        self._lock = threading.Lock()
        self._actors: dict[int, Any] = {}  # by the id of the slot thread's call
        self._gpus = bringup.NodeGpus()
        self._outcome = _Outcome()
        # (is a change of membership, the dict): rank 0's log() dicts and the changes,
        # in the order they happened, for the run's own thread to deliver.
        self._events: queue.Queue = queue.Queue()
        self._driver: elastic_driver.Driver | None = None
        self._server: RendezvousServer | None = None
        self._call: tuple[ray.ObjectRef, bytes | None] | None = None
        self._discovery: NodeDiscovery | None = None
        self._notices = draining.Notices()  # for get_preemption_info()
        self._local = True
        self._common_env: dict[str, str] = {}

    def run(self, fn: bytes, args: bytes | None, callbacks: list[Callable[[dict], None]]):
        """Runs the call elastically to its end; the final world's results in rank order.

        Raises:
            ElasticLimitError: Below ``min_workers`` for ``elastic_timeout``, or more than
                ``reset_limit`` resets.
            WorkerFailedError: The job failed otherwise (every host failed, ...).
            HorovodRayError: stop() ended the run.
        """
        result: dict[str, Any] = {}
        stopped_early, autoscaler = True, None
        try:
            per_rank = self._worker.worker_resources()
            self._call = (ray.put(fn), args)
            driver = self._open(per_rank)
            autoscaler = self._autoscaler_request(per_rank)
            if autoscaler is not None:
                autoscaler.ask()
            thread = threading.Thread(
                target=self._drive, args=(driver, result), name="horovod_ray-elastic", daemon=True
            )
            thread.start()
            deliver = (logs.to_all(callbacks), logs.to_membership_hooks(callbacks))
            while thread.is_alive() and self._state.is_in(RunState.RUNNING):
                self._deliver(deliver)
                if autoscaler is not None:
                    autoscaler.renew()
                thread.join(DELIVER_S)
            self._deliver(deliver)
            # The run's own end moves it on; stop() from another thread already has.
            stopped_early = not self._state.transition([RunState.RUNNING], RunState.STOPPING)
            if stopped_early:
                self._release()
                thread.join(STOP_JOIN_S)
        finally:
            self.stop()
            if autoscaler is not None:
                autoscaler.withdraw()
            self._state.transition([RunState.STOPPING], RunState.ENDED)
        if stopped_early:
            raise HorovodRayError("the elastic run was ended by stop()")
        return self._conclude(result)

    def _open(self, per_rank: dict[str, float]) -> elastic_driver.Driver:
        """Creates the driver and starts the rendezvous; the run is then RUNNING."""
        layout = self._layout
        driver_ip = ray.util.get_node_ip_address()
        # A job whose every node with room is on the driver's machine stays there.
        nodes = staying(ray.nodes(), draining.draining_nodes())
        self._local = bringup.is_local(addresses_with_room(nodes, per_rank), driver_ip)
        bind = bringup.bind_address(self._local, driver_ip)
        only_ip = driver_ip if self._local else None
        discovery = NodeDiscovery(
            per_rank, only_ip, layout.discovery_interval_s, layout.discovery, self._on_leaving
        )
        self._discovery = discovery
        bind_ranks = getattr(layout.discovery, "bind_ranks", None)
        if callable(bind_ranks):
            bind_ranks(self._rank_actor_ids)  # a TestDiscovery's forceful changes kill only ours
        with self._lock:
            if not self._state.transition([RunState.CREATED], RunState.RUNNING):
                raise HorovodRayError("the elastic run was ended by stop()")
            store = elastic_driver.Store(self._on_world)
            self._driver = driver = elastic_driver.Driver(
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
                bind,
                [bind],
                self._settings.verbose,
                hooks=elastic_driver.DriverHooks(driver),
                gloo_timeout_s=self._settings.timeout_s,
            )
            store.server = server
            server.start([])
        self._common_env = bringup.common_env(server, self._settings, elastic=True)
        return driver

    def _autoscaler_request(self, per_rank: dict[str, float]) -> AutoscalerRequest | None:
        """The job's request for room; None for a job kept on the driver's machine, whose
        discovery counts only nodes with the driver's address: the nodes an autoscaler
        launches are other machines, which it would keep up and never use."""
        if self._local:
            logger.info(
                "elastic job: every node with room for a rank is on the driver's machine, "
                "so the job stays there and asks the autoscaler for no nodes (with a head "
                "node without CPUs for ranks, it grows onto the nodes launched for it)"
            )
            return None
        return AutoscalerRequest(self._layout, per_rank)

    def _drive(self, driver: elastic_driver.Driver, result: dict[str, Any]) -> None:
        """The driver's thread: starts the first world and waits for the last one's end."""
        try:
            driver.start(self._layout.min_workers, self.run_slot)
            result["results"] = driver.get_results()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            result["error"] = err

    def _deliver(self, deliver: tuple[Callable[[dict], None], Callable[[dict], None]]) -> None:
        """Hands what came since the last time to the callbacks: rank 0's dicts to every
        callback, each change of membership to those that ask for them."""
        to_all, to_hooks = deliver
        while True:
            try:
                is_change, item = self._events.get_nowait()
            except queue.Empty:
                return
            if is_change:
                logger.info("elastic job: %s", item)
                to_hooks(item)
            else:
                to_all(item)

    def _on_world(self, world: list[RankInfo]) -> None:
        with self._lock:
            before = self._outcome.worlds[-1] if self._outcome.worlds else []
            self._outcome.worlds.append(world)
            resets = len(self._outcome.worlds) - 1
        if self._world_hook is not None:
            self._world_hook(len(world), resets)
        self._events.put((True, membership_change(before, world, resets)))

    def _conclude(self, result: dict[str, Any]) -> list[Any]:
        """The final world's results, or the error ``attribution.elastic_error`` decides."""
        layout, driver, outcome = self._layout, self._driver, self._outcome
        results = result.get("results")
        message = (results.error_message if results else None) or driver.gave_up or ""
        last = len(outcome.worlds) - 1
        end = attribution.ElasticEnd(
            available=min(driver.available_slots(), layout.max_workers or sys.maxsize),
            timed_out_waiting=driver.timed_out_waiting,
            crashed=result.get("error"),
            driver_message=message,
            reset_limit_hit=elastic_driver.reset_limit_hit(message),
            exit_failed=bool(results)
            and any(code != 0 for code, _ in results.worker_results.values()),
            final_size=len(outcome.worlds[-1]) if outcome.worlds else 0,
            num_results=len(outcome.results),
            last_failures={r: t for (w, r), t in outcome.failures.items() if w == last},
        )
        error = attribution.elastic_error(
            end, layout.min_workers, layout.reset_limit, layout.elastic_timeout_s
        )
        if error is not None:
            raise error from end.crashed
        return [outcome.results[rank] for rank in sorted(outcome.results)]

    def stop(self) -> None:
        """Ends the driver, every worker and the rendezvous. Safe to call more than once,
        from any thread; ``run()`` then raises in its own."""
        with self._lock:
            self._state.transition([RunState.CREATED, RunState.RUNNING], RunState.STOPPING)
        self._release()

    def _rank_actor_ids(self) -> set[str]:
        """The ids (hex) of the rank actors this run holds now."""
        with self._lock:
            return {actor._actor_id.hex() for actor in self._actors.values()}

    def _release(self) -> None:
        with self._lock:
            driver, server = self._driver, self._server
            actors = list(self._actors.values())
            self._actors.clear()
        if driver is not None:
            driver.stop_now()
        bringup.kill(actors)
        if server is not None:
            server.stop()

    def wait_ended(self, timeout_s: float) -> bool:
        """Waits until run() has released everything; False if ``timeout_s`` passed."""
        return self._state.wait_for({RunState.ENDED}, timeout_s)

    def _ending(self) -> bool:
        return self._state.is_in(RunState.STOPPING, RunState.ENDED)

    def run_slot(self, slot: SlotInfo, events: Sequence[threading.Event]) -> tuple[int, float]:
        """One rank from start to exit (horovod's driver calls it, in its own thread).

        Never raises: horovod counts the return value, ``(exit code, time)``.
        """
        key = threading.get_ident()
        where = f"on node {slot.hostname[:12]}, local rank {slot.local_rank}"
        actor = None
        try:
            strategy = NodeAffinitySchedulingStrategy(slot.hostname, soft=False)
            actor = bringup.spawn(self._worker, strategy)
            with self._lock:
                if self._ending():
                    raise _ReleasedError()
                self._actors[key] = actor
            check = self._checker(events)
            timeout_s = self._settings.placement_group_timeout_s
            facts = bringup.get_one(actor.node_info.remote(), timeout_s, check)
            where = f"{facts.where}, local rank {slot.local_rank}"
            priority.check(self._settings.niceness, [facts])
            value = self._set_up_and_call(actor, slot, key, facts, check)
            with self._lock:
                self._outcome.results[self._driver.world_rank(slot)] = value
            return 0, time.time()
        except _ReleasedError:
            logger.info("elastic job: the rank %s was let go", where)
            return 1, time.time()
        except Exception as err:  # noqa: BLE001 - horovod counts the exit code
            if self._left(slot, err):
                logger.info("elastic job: the rank %s left with its node", where)
                return 1, time.time()
            with self._lock:
                reset = len(self._outcome.worlds) - 1
                self._outcome.failures[reset, slot.rank] = probe.describe(err, where)
            logger.warning("elastic job: rank %d %s ended: %s", slot.rank, where, err)
            return 1, time.time()
        finally:
            self._gpus.remove(slot.hostname, key)
            with self._lock:
                self._actors.pop(key, None)
            if actor is not None:
                bringup.kill([actor])

    def _left(self, slot: SlotInfo, err: Exception) -> bool:
        """Whether a rank ended because its node left the job (Ray drains it, or the user's
        discovery dropped it), not because it failed: horovod refuses such a rank a place
        in the next world, and its process exits (its actor dies; one being placed there
        cannot be). What the rank's own code raised is a failure even there."""
        if REMOVED_FROM_JOB in probe.text_of(err):
            return True
        drained = self._discovery is not None and self._discovery.drained(slot.hostname)
        return drained and not isinstance(err, ray.exceptions.RayTaskError)

    def _set_up_and_call(
        self, actor: Any, slot: SlotInfo, key: int, facts: NodeFacts, check: Callable[[], None]
    ) -> Any:
        """The rest of one slot's bring-up (GPUs, interface, environment, setup), then the
        user's call; its value."""
        timeout_s = self._settings.placement_group_timeout_s
        gpus: tuple[str, ...] = ()
        if facts.gpu_ids:
            self._gpus.add(slot.hostname, key, facts.gpu_ids)
            gpus = self._gpus.visible(
                slot.hostname, key, slot.local_rank, slot.local_size, timeout_s, check
            )
        rank = elastic_driver.rank_info(slot, gpus)
        iface = network.gloo_iface(facts, self._settings.nics, self._local)
        self._server.allow(facts.node_ip)
        env = bringup.rank_env(rank, self._common_env, iface, self._extra_env)
        setup = bringup.setup(actor, env, rank, self._executable, self._settings.niceness)
        bringup.get_one(setup, timeout_s, check)
        if self._datasets is not None:
            bringup.get_one(actor.take_datasets.remote(self._datasets), timeout_s, check)
        fn_ref, args = self._call
        ref = actor.call.remote(1, None, fn_ref, args)
        # Every rank's channel is open in an elastic job; it posts while it is rank 0.
        check = self._telling(actor, check)
        return logs.collect(actor, [ref], lambda item: self._events.put((False, item)), 1, check)[0]

    def _telling(self, actor: Any, check: Callable[[], None]) -> Callable[[], None]:
        """``check``, which also hands the rank every preemption notice it has not had."""
        told = 0

        def check_and_tell() -> None:
            nonlocal told
            check()
            notices = self._notices.since(told)
            if notices:
                told = notices[-1][0]
                draining.tell([actor], notices)

        return check_and_tell

    def _on_leaving(self, node_id: str, deadline_ms: int | None) -> None:
        """The discovery saw a node the job used drain, before horovod's driver re-forms
        the world without it: a notice with its ranks in the world now."""
        with self._lock:
            world = self._outcome.worlds[-1] if self._outcome.worlds else []
        self._notices.add(
            node_id, [r.world_rank for r in world if r.node_id == node_id], deadline_ms
        )

    def _checker(self, events: Sequence[threading.Event]) -> Callable[[], None]:
        """What a slot's waits call: raises once the driver or stop() lets the slot go."""

        def check() -> None:
            if self._ending() or any(event.is_set() for event in events):
                raise _ReleasedError()

        return check
