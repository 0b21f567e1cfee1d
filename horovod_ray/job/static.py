"""A static job: a fixed set of ranks, placed once at start() and kept until stop().

Start is all-or-nothing. The job plans its placement (``placement``), reserves the group,
then walks the bring-up path (``bringup``) for all its ranks at once: one actor per
bundle slot -> each actor's node facts -> ranks (``assignment.assign_ranks``, pure) -> each
node's Gloo interface (``network``, pure) -> the rendezvous server -> each rank's
environment -> setup. Everything taken is recorded in a ``held.Held`` as it is taken, so
that a failure at any step releases it all (``held.release``).

A call goes to every rank (``calls``). When one fails, ``probe.probe`` looks at every
rank, the job is released, ``attribution.attribute`` decides which ranks caused it, and the
caller gets ``attribution.error_for``'s error.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable

import ray
from ray.util.client import ray as ray_client
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from horovod_ray.errors import HangError, HorovodRayError, PlacementTimeoutError
from horovod_ray.failures import attribution, hangs, probe
from horovod_ray.job import bringup, draining, placement
from horovod_ray.job.held import Held, Rendezvous, release
from horovod_ray.job.layouts import WorkerLayout
from horovod_ray.rank import calls, logs, network, priority, timeline
from horovod_ray.rank.assignment import RankInfo, WorkerRecord, assign_ranks
from horovod_ray.rank.network import NodeFacts
from horovod_ray.rendezvous.cluster import ClusterRendezvous
from horovod_ray.rendezvous.server import RendezvousServer
from horovod_ray.settings import Settings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Member:
    """One rank of a running job: its actor, its identity, where it runs."""

    actor: Any
    rank: RankInfo
    node: NodeFacts


def table(members: tuple[Member, ...]) -> str:
    """The ranks, a line each: world rank, local and cross rank/size, node, ip, GPUs."""
    lines = ["rank  local  cross  node              ip               gpus"]
    for member in members:
        rank = member.rank
        lines.append(
            f"{rank.world_rank:>4}  {rank.local_rank:>2}/{rank.local_size:<2}  "
            f"{rank.cross_rank:>2}/{rank.cross_size:<2}  {rank.node_id[:16]:<16}  "
            f"{member.node.node_ip:<15}  {','.join(rank.visible_gpus) or '-'}"
        )
    return "\n".join(lines)


class StaticJob:
    """The job kind of ``RayExecutor(num_workers=...)`` / ``num_hosts``: every call is
    taken, on the ranks placed at start.

    Args:
        settings: Timeouts, interfaces, verbosity.
        layout: How many ranks, where, and what each reserves.
    """

    def __init__(self, settings: Settings, layout: WorkerLayout) -> None:
        self._settings = settings
        self._layout = layout
        self._extra_env: dict[str, str] = {}
        self._executable: bytes | None = None
        self._plan: placement.PlacementPlan | None = None
        self._group: PlacementGroup | None = None
        self._dispatcher = calls.Dispatcher()
        self._release_lock = threading.Lock()
        self._released = False
        self.held = Held()
        # In world-rank order; set once start() has placed every rank.
        self.members: tuple[Member, ...] = ()
        # Whether Ray drains one of the members' nodes, and what the job does then; asked
        # during calls.
        self._grace = draining.Grace(draining.Watch(set()), [], [], False)
        # Seconds start() spent reserving the group, starting the actors, and setting up
        # the ranks' environments (the rendezvous server included).
        self.start_s: dict[str, float] = {}

    # ------------------------------------------------------------------------ start

    def prepare(self) -> None:
        """Plans the placement: a bad layout raises ConfigError before anything is taken."""
        if self._layout.hosts is not None:
            # Named nodes: matched now, before anything is taken (an unknown host fails).
            names = [name for name, _ in self._layout.hosts]
            driver = ray.get_runtime_context().get_node_id()
            node_ids = placement.match_hosts(names, ray.nodes(), driver)
            self._plan, self._group = placement.plan_hosts(self._layout, node_ids), None
            return
        group = placement.current_group(self._layout)
        if group is None:
            self._layout.require_counts()
            self._plan = placement.plan_new_group(self._layout)
        else:
            self._plan = placement.plan_existing_group(self._layout, group.bundle_specs)
        self._group = group

    def start(
        self, extra_env: dict[str, str], executable: bytes | None, check: Callable[[], None]
    ) -> None:
        """Places the ranks, starts the rendezvous, sets every rank up; on any failure
        releases what it took and re-raises. Calls ``check`` at every wait; whatever it
        raises ends the start.

        Args:
            extra_env: More environment variables for every rank.
            executable: ``executable_cls`` pickled with its arguments, or None.
            check: Called at every wait.
        """
        self._extra_env, self._executable = extra_env, executable
        try:
            self.members = self._place(check)
            self._grace = draining.Grace(
                draining.Watch({m.node.node_id for m in self.members}),
                [m.actor for m in self.members],
                [m.node.node_id for m in self.members],
                self._settings.storage is not None,
            )
            began = time.perf_counter()
            envs = self._environments()
            setups = [
                bringup.setup(m.actor, env, m.rank, self._executable, self._settings.niceness)
                for m, env in zip(self.members, envs, strict=True)
            ]
            bringup.wait_all(setups, math.inf, check)
            wheres = [m.node.where for m in self.members]
            probe.get_all(setups, "set up its environment or build executable_cls", wheres)
            self.start_s["environment"] = time.perf_counter() - began
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _place(self, check: Callable[[], None]) -> tuple[Member, ...]:
        """Reserves the group, starts one actor per slot; the ranks in world-rank order."""
        held, plan, timeout_s = self.held, self._plan, self._settings.placement_group_timeout_s
        began = time.perf_counter()
        if plan.bundles:
            held.group = placement.reserve(plan, timeout_s, check=check)
            held.owns_group = True
        else:
            held.group = self._group
        self.start_s["placement"] = time.perf_counter() - began
        began = time.perf_counter()
        for bundle_index in plan.worker_bundles:
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=held.group, placement_group_bundle_index=bundle_index
            )
            held.actors.append(bringup.spawn(self._layout, strategy))
        # The first answer from each actor also tells us it was scheduled.
        info_refs = [actor.node_info.remote() for actor in held.actors]
        not_ready = bringup.wait_all(info_refs, timeout_s, check)
        if not_ready:
            raise PlacementTimeoutError(
                f"{len(not_ready)} of {len(info_refs)} workers were not scheduled within "
                f"placement_group_timeout_s={timeout_s:g}s inside the placement group "
                f"(bundles {held.group.bundle_specs}); give the group more room or fewer "
                f"workers"
            )
        nodes: list[NodeFacts] = probe.get_all(info_refs, "report its node")
        priority.check(self._settings.niceness, nodes)
        self.start_s["actors"] = time.perf_counter() - began
        infos = assign_ranks([WorkerRecord(n.node_id, n.gpu_ids) for n in nodes])
        members = (Member(a, i, n) for a, i, n in zip(held.actors, infos, nodes, strict=True))
        return tuple(sorted(members, key=lambda m: m.rank.world_rank))

    def _environments(self) -> list[dict[str, str]]:
        """Chooses each node's interface, starts the rendezvous; each rank's environment."""
        settings, held = self._settings, self.held
        nodes = [m.node for m in self.members]
        # A Ray Client driver is outside the cluster, out of the workers' reach: its
        # rendezvous server then runs on rank 0's node instead of the driver's.
        client = ray_client.is_connected()
        host_ip = nodes[0].node_ip if client else ray.util.get_node_ip_address()
        local = bringup.is_local((node.node_ip for node in nodes), host_ip)
        # Decided for every node before the rendezvous server starts: a node that cannot
        # take part fails the start with nothing more taken.
        ifaces = network.gloo_ifaces(nodes, settings.nics, local)
        network.check_hostnames(nodes, local)
        bind = bringup.bind_address(local, host_ip)
        allowed = {bind} | {node.node_ip for node in nodes}
        if client:
            held.rendezvous = ClusterRendezvous(
                nodes[0].node_id,
                bind,
                allowed,
                settings.verbose,
                settings.placement_group_timeout_s,
                gloo_timeout_s=settings.timeout_s,
            )
        else:
            held.rendezvous = RendezvousServer(
                bind, allowed, settings.verbose, gloo_timeout_s=settings.timeout_s
            )
        held.rendezvous.start([m.rank for m in self.members])
        common = bringup.common_env(held.rendezvous, settings, elastic=False)
        return [
            bringup.rank_env(m.rank, common, iface, self._extra_env)
            for m, iface in zip(self.members, ifaces, strict=True)
        ]

    def give_datasets(self, per_rank: list[dict[str, Any]]) -> None:
        """Each rank's iterators over the job's datasets (``per_rank``, in world-rank
        order), for ``get_dataset_shard``.

        Raises:
            WorkerFailedError: A rank died or failed to take them.
        """
        refs = [
            m.actor.take_datasets.remote(shards)
            for m, shards in zip(self.members, per_rank, strict=True)
        ]
        probe.get_all(refs, "take its datasets", [m.node.where for m in self.members])

    def started_message(self) -> str:
        """What start() logs: its phases, the rendezvous, the rank table."""
        host, port = self.held.rendezvous.address
        phases = ", ".join(f"{name} {s:.2f}s" for name, s in self.start_s.items())
        return f"Horovod job started ({phases}), rendezvous {host}:{port}\n{table(self.members)}"

    # ------------------------------------------------------------------------ calls

    def refuse(self, action: str, call: calls.Call | None) -> None:
        """A static job takes every call and answers every question about its ranks."""

    def admit(self) -> None:
        """Calls may overlap (``run_remote`` then ``run``): nothing to claim."""

    @property
    def actors(self) -> list[Any]:
        return [m.actor for m in self.members]

    @property
    def ranks(self) -> list[RankInfo]:
        return [m.rank for m in self.members]

    @property
    def rendezvous(self) -> Rendezvous:
        return self.held.rendezvous

    @property
    def rendezvous_address(self) -> tuple[str, int]:
        return self.held.rendezvous.address

    @property
    def placement_group(self) -> PlacementGroup | None:
        return self.held.group

    def call(
        self,
        call: calls.Call,
        callbacks: list[Callable[[dict], None]],
        all_ranks: bool = True,
        failing: Callable[[], bool] = lambda: True,
    ) -> list[Any]:
        """Runs ``call`` on every rank (rank 0 only without ``all_ranks``), passing rank
        0's ``log()`` dicts to ``callbacks``; each rank's value, in world-rank order.
        ``failing`` is called when a rank failed, before the ranks are looked at and the job
        is released (see :meth:`_fail`).

        Raises:
            WorkerFailedError: A rank raised or died; the job has been released.
        """
        actors = self.actors if all_ranks else self.actors[:1]
        message, refs = self._dispatcher.send(call, actors, all_ranks)
        started = time.monotonic()
        check = self._grace.check
        try:
            if callbacks:
                deliver = logs.to_all(callbacks)
                results = logs.collect(actors[0], refs, deliver, message.call_id, check)
            else:
                results = logs.wait_all(refs, check)
        except ray.exceptions.RayError:
            self._fail(refs, time.monotonic() - started, failing)
        except draining.LeavingError as drain:
            # A rank's own failure, seen in the same pass, comes first.
            if any(probe.error_of(ref) is not None for ref in refs):
                self._fail(refs, time.monotonic() - started, failing)
            self._leave(refs, drain.leaving, failing)
        self._dispatcher.completed(call, message)
        return results

    def stacks(self, timeout_s: float) -> dict[int, str]:
        """Every rank's stacks, asked on the ranks' control threads."""
        texts = probe.stacks(self.actors, range(len(self.members)), timeout_s)
        return {
            rank: text
            or f"rank {rank} {self.members[rank].node.where} gave no stacks within {timeout_s:g}s\n"
            for rank, text in texts.items()
        }

    def send(self, call: calls.Call) -> list[ray.ObjectRef]:
        """Starts ``call`` on every rank without waiting; one ref per rank, holding what
        the function returned or, as it was raised, what it raised."""
        return self._dispatcher.send(call, self.actors, as_raised=True)[1]

    def _fail(
        self, refs: list[ray.ObjectRef], elapsed_s: float, failing: Callable[[], bool]
    ) -> None:
        """Works out who caused a failure (see attribution.py), releases the job, raises.

        ``failing()`` comes first: from then on no stop() releases the ranks while they are
        looked at, which would blame the failure on the ranks it killed. When the job was
        already being stopped (a stop(), another call's failure), the ranks' state says
        nothing of this call: it is released and raises at once.
        """
        if not failing():
            self._release_failed(refs)
            raise HorovodRayError("the job was stopped while the call ran")
        timeout_s = self._settings.timeout_s
        stopped = probe.settle_if_collectives_stopped(refs)
        snapshot, first = probe.probe(
            self.actors,
            [m.node.where for m in self.members],
            [m.node.node_id for m in self.members],
            refs,
            self.rendezvous.joined_ranks(),
            elapsed_s,
            timeout_s,
        )
        lost = any(view.seen in attribution.LOST for view in snapshot.ranks)
        error = self._hang_error(snapshot) if stopped and not lost else None
        if error is None:
            error = attribution.error_for(attribution.attribute(snapshot), timeout_s)
        self._release_failed(refs)
        raise error from first

    def _leave(
        self, refs: list[ray.ObjectRef], leaving: dict[str, float], failing: Callable[[], bool]
    ) -> None:
        """Stops the job because Ray drains one of its nodes, once rank 0 has committed
        the checkpoints it was uploading (see ``Grace.finish_uploads``); raises
        NodeDrainingError naming the ranks there (a static job cannot leave a node)."""
        if not failing():
            self._release_failed(refs)
            raise HorovodRayError("the job was stopped while the call ran")
        where = {m.rank.world_rank: (m.node.where, m.node.node_id) for m in self.members}
        error = draining.static_job_error(where, leaving)
        logger.warning("%s", str(error).splitlines()[0])
        self._grace.finish_uploads(leaving)
        self._release_failed(refs)
        self._grace.settle()
        raise error from None

    def _release_failed(self, refs: list[ray.ObjectRef]) -> None:
        """Releases the job at once, then reads every rank's outcome of the failed call,
        so that Ray does not log the rest as unhandled errors."""
        self.stop(grace_s=0)
        for ref in refs:
            probe.error_of(ref)

    def _hang_error(self, snapshot: attribution.Snapshot) -> HangError | None:
        """The HangError, if horovod shut the job down for a stall or every rank waited
        in a collective for Gloo's timeout; read now, before anything is released."""
        running = [r for r, view in enumerate(snapshot.ranks) if view.running]
        stacks, stderr = probe.stacks_and_stderr(self.actors, running, probe.LIVENESS_TIMEOUT_S)
        stall = hangs.stalled(snapshot, hangs.stall_report(stderr[0]))
        if stall is not None:
            return hangs.hang_error(stall, snapshot, self._settings.stall_timeout_s, stacks)
        return hangs.gloo_timed_out(snapshot, stderr, self._settings.timeout_s)

    # ------------------------------------------------------------------------- stop

    def stop(self, grace_s: float) -> None:
        """Releases everything the job holds, once (see :func:`release`)."""
        with self._release_lock:
            if self._released:
                return
            self._released = True
            try:
                if self._settings.timeline is not None and self.members:
                    timeline.bring(self.members[0].actor, self._settings.timeline)
            finally:
                release(self.held, grace_s)
