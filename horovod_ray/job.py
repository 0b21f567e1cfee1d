"""A running job's parts, how start() assembles them all-or-nothing, and their release.

The data flows one way: placement (reserve the group) -> one actor per bundle slot ->
each actor's node facts -> ranks (pure assignment) -> each node's Gloo interface (pure)
-> the rendezvous server -> each rank's environment. Everything taken is recorded in a
:class:`Held` as it is taken, so that a failure at any step releases it all.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, Callable

import ray
from ray.util.client import ray as ray_client
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from horovod_ray import network, placement
from horovod_ray.errors import PlacementTimeoutError, WorkerFailedError
from horovod_ray.failures import describe, error_of
from horovod_ray.network import NodeFacts
from horovod_ray.ranks import RankInfo, WorkerRecord, assign_ranks
from horovod_ray.rendezvous import ClusterRendezvous, RendezvousServer, worker_env
from horovod_ray.settings import Settings, WorkerLayout
from horovod_ray.worker import RemoteWorker

logger = logging.getLogger(__name__)

# Seconds to wait for Ray to confirm that killed workers are gone.
STOP_CONFIRM_S = 10.0

Rendezvous = RendezvousServer | ClusterRendezvous


@dataclasses.dataclass(frozen=True)
class Member:
    """One rank of a running job: its actor, its identity, where it runs."""

    actor: Any
    rank: RankInfo
    node: NodeFacts


@dataclasses.dataclass
class Held:
    """What a job holds, or what start() has taken so far; given back by :func:`release`."""

    group: PlacementGroup | None = None
    owns_group: bool = False
    actors: list[Any] = dataclasses.field(default_factory=list)
    rendezvous: Rendezvous | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """A started job, in world-rank order; published only once start() succeeded."""

    members: tuple[Member, ...]
    held: Held
    # Seconds start() spent reserving the group, starting the actors, and setting up
    # the ranks' environments (the rendezvous server included).
    start_s: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def actors(self) -> list[Any]:
        return [m.actor for m in self.members]

    @property
    def rendezvous(self) -> Rendezvous:
        return self.held.rendezvous

    def table(self) -> str:
        """The ranks, a line each: world rank, local and cross rank/size, node, ip, GPUs."""
        lines = ["rank  local  cross  node              ip               gpus"]
        for member in self.members:
            rank = member.rank
            lines.append(
                f"{rank.world_rank:>4}  {rank.local_rank:>2}/{rank.local_size:<2}  "
                f"{rank.cross_rank:>2}/{rank.cross_size:<2}  {rank.node_id[:16]:<16}  "
                f"{member.node.node_ip:<15}  {','.join(rank.visible_gpus) or '-'}"
            )
        return "\n".join(lines)


def start(
    settings: Settings,
    layout: WorkerLayout,
    plan: placement.PlacementPlan,
    group: PlacementGroup | None,
    executable: bytes | None,
    extra_env: dict[str, str],
    held: Held,
    check: Callable[[], None],
) -> Job:
    """Places the ranks, starts the rendezvous, sets every rank up.

    Records everything it takes in ``held`` (the caller releases it on failure). Calls
    ``check`` at every wait; whatever it raises ends the start.
    """
    start_s: dict[str, float] = {}
    members = _place(settings, layout, plan, group, held, check, start_s)
    began = time.perf_counter()
    envs = _environments(settings, members, held)
    setups = [
        m.actor.setup.remote({**env, **extra_env}, m.rank.world_rank == 0, executable)
        for m, env in zip(members, envs, strict=True)
    ]
    placement.wait_all(setups, math.inf, check)
    get_all(setups, what="set up its environment or build executable_cls", members=members)
    start_s["environment"] = time.perf_counter() - began
    return Job(members, held, start_s)


def _place(
    settings: Settings,
    layout: WorkerLayout,
    plan: placement.PlacementPlan,
    group: PlacementGroup | None,
    held: Held,
    check: Callable[[], None],
    start_s: dict[str, float],
) -> tuple[Member, ...]:
    """Reserves the group, starts one actor per slot; the ranks in world-rank order."""
    timeout_s = settings.placement_group_timeout_s
    began = time.perf_counter()
    if plan.bundles:
        group = placement.reserve(plan, timeout_s, check=check)
        held.group, held.owns_group = group, True
    else:
        held.group = group
    start_s["placement"] = time.perf_counter() - began
    began = time.perf_counter()
    for bundle_index in plan.worker_bundles:
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle_index
        )
        held.actors.append(
            RemoteWorker.options(
                num_cpus=layout.cpus_per_worker, num_gpus=layout.gpus, scheduling_strategy=strategy
            ).remote()
        )
    # The first answer from each actor also tells us it was scheduled.
    info_refs = [actor.node_info.remote() for actor in held.actors]
    not_ready = placement.wait_all(info_refs, timeout_s, check)
    if not_ready:
        raise PlacementTimeoutError(
            f"{len(not_ready)} of {len(info_refs)} workers were not scheduled within "
            f"placement_group_timeout_s={timeout_s:g}s inside the placement group "
            f"(bundles {group.bundle_specs}); give the group more room or fewer workers"
        )
    nodes: list[NodeFacts] = get_all(info_refs, what="report its node")
    start_s["actors"] = time.perf_counter() - began
    infos = assign_ranks([WorkerRecord(n.node_id, n.gpu_ids) for n in nodes])
    members = (Member(a, i, n) for a, i, n in zip(held.actors, infos, nodes, strict=True))
    return tuple(sorted(members, key=lambda m: m.rank.world_rank))


def _environments(
    settings: Settings, members: tuple[Member, ...], held: Held
) -> list[dict[str, str]]:
    """Chooses each node's interface, starts the rendezvous; each rank's environment."""
    nodes = [m.node for m in members]
    # A Ray Client driver is outside the cluster, out of the workers' reach: its
    # rendezvous server then runs on rank 0's node instead of the driver's.
    client = ray_client.is_connected()
    host_ip = nodes[0].node_ip if client else ray.util.get_node_ip_address()
    local_job = all(node.node_ip == host_ip for node in nodes)
    # Decided for every node before the rendezvous server starts: a node that cannot
    # take part fails the start with nothing more taken.
    ifaces = network.gloo_ifaces(nodes, settings.nics, local_job)
    network.check_hostnames(nodes, local_job)
    bind_address = "127.0.0.1" if local_job else host_ip
    allowed = {bind_address} | {node.node_ip for node in nodes}
    if client:
        held.rendezvous = ClusterRendezvous(
            nodes[0].node_id,
            bind_address,
            allowed,
            settings.verbose,
            settings.placement_group_timeout_s,
        )
    else:
        held.rendezvous = RendezvousServer(bind_address, allowed, settings.verbose)
    held.rendezvous.start([m.rank for m in members])
    common = {
        **worker_env(held.rendezvous),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(math.ceil(settings.timeout_s)),
    }
    return [
        {**common, **m.rank.env(), "HOROVOD_GLOO_IFACE": iface}
        for m, iface in zip(members, ifaces, strict=True)
    ]


def get_all(refs: list[ray.ObjectRef], what: str, members: tuple[Member, ...] = ()) -> list[Any]:
    """ray.get of every ref; WorkerFailedError naming each rank whose ref failed."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayError as first:
        failures = {}
        for index, ref in enumerate(refs):
            err = error_of(ref)
            if err is not None:
                where = describe(err, members[index].node.where) if members else str(err)
                failures[index] = f"failed to {what}: {where}"
        raise WorkerFailedError(failures) from first


def release(held: Held, grace_s: float) -> None:
    """Gives back what a job holds, newest first; each step runs whatever the last did.

    Idle workers get ``grace_s`` to exit on their own, then are killed; returns once Ray
    has seen them die (so their resources are free), after the rendezvous server is
    closed and a placement group the job created is removed.
    """
    actors, rendezvous = held.actors, held.rendezvous
    try:
        if actors:
            exits = [actor.exit.remote() for actor in actors]
            if grace_s > 0:
                ray.wait(exits, num_returns=len(exits), timeout=grace_s)
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone is fine
                    logger.debug("kill of a worker failed", exc_info=True)
            ray.wait(exits, num_returns=len(exits), timeout=STOP_CONFIRM_S)
    finally:
        try:
            if rendezvous is not None:
                rendezvous.stop()
        finally:
            if held.group is not None and held.owns_group:
                ray.util.remove_placement_group(held.group)
