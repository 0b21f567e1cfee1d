"""Placement: which placement group the workers go in, and which bundle each one takes.

* ``num_workers=N``: N bundles of one worker each, ``PACK`` (fill nodes, spill over).
* ``num_hosts=H, num_workers_per_host=S``: H bundles of S workers each, ``STRICT_SPREAD``
  (one bundle per node).
* ``hosts=[(host, S), ...]`` (horovodrun's host list): one bundle of S workers on each
  named node, pinned there by its node id, in the order given.
* Inside a placement group that already exists (a Tune trial, a user's actor), with
  ``use_current_placement_group=True``: that group's bundles, none created.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.util.placement_group import PlacementGroup

from horovod_ray.errors import ConfigError, PlacementTimeoutError
from horovod_ray.job.bringup import wait_all
from horovod_ray.job.layouts import WorkerLayout

logger = logging.getLogger(__name__)

# Ray picks any bundle of the group that has room.
ANY_BUNDLE = -1
# The label every Ray node carries with its id: a bundle that selects it takes that node.
NODE_ID_LABEL = "ray.io/node-id"


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """Bundles to reserve (empty when reusing a group) and each worker's bundle index."""

    bundles: tuple[dict[str, float], ...]
    strategy: str
    worker_bundles: tuple[int, ...]
    # Per bundle, the node it must take (Ray's label selectors); empty: any node.
    node_ids: tuple[str, ...] = ()

    @property
    def num_workers(self) -> int:
        return len(self.worker_bundles)


def plan_new_group(layout: WorkerLayout) -> PlacementPlan:
    """The placement group to create for ``layout`` (which must give a worker count)."""
    layout.require_counts()
    per_worker = layout.worker_resources()
    if layout.num_workers is not None:
        return PlacementPlan(
            bundles=tuple(dict(per_worker) for _ in range(layout.num_workers)),
            strategy="PACK",
            worker_bundles=tuple(range(layout.num_workers)),
        )
    slots = layout.num_workers_per_host
    host_bundle = {name: amount * slots for name, amount in per_worker.items()}
    return PlacementPlan(
        bundles=tuple(dict(host_bundle) for _ in range(layout.num_hosts)),
        strategy="STRICT_SPREAD",
        worker_bundles=tuple(i // slots for i in range(layout.num_hosts * slots)),
    )


def nodes_named(host: str, nodes: Sequence[Mapping[str, Any]], driver_node_id: str) -> list[str]:
    """The ids of the alive nodes ``host`` names: by address, host name or node id, or
    ``localhost`` (also 127.0.0.1) for the driver's node. Pure; ``nodes`` is ``ray.nodes()``."""
    alive = [node for node in nodes if node.get("Alive")]
    if host in ("localhost", "127.0.0.1"):
        return [n["NodeID"] for n in alive if n["NodeID"] == driver_node_id]
    return [
        n["NodeID"]
        for n in alive
        if host in (n.get("NodeManagerAddress"), n.get("NodeManagerHostname"), n["NodeID"])
    ]


def match_hosts(
    hosts: Sequence[str], nodes: Sequence[Mapping[str, Any]], driver_node_id: str
) -> list[str]:
    """The Ray node each named host is, in order (see :func:`nodes_named`). Pure.

    Raises:
        ConfigError: A host that is no alive node, or several, or a node named twice;
            the message lists the cluster's nodes.
    """
    listing = ", ".join(
        f"{n['NodeManagerAddress']} ({n.get('NodeManagerHostname', '?')})"
        for n in nodes
        if n.get("Alive")
    )
    chosen: list[str] = []
    for host in hosts:
        found = nodes_named(host, nodes, driver_node_id)
        if len(found) != 1:
            what = "is no node of this Ray cluster" if not found else "names several nodes"
            raise ConfigError(
                "hosts", f"host {host!r} {what}; give a node's address or host name: {listing}"
            )
        if found[0] in chosen:
            raise ConfigError("hosts", f"host {host!r} is a node named already; give each once")
        chosen.append(found[0])
    return chosen


def plan_hosts(layout: WorkerLayout, node_ids: Sequence[str]) -> PlacementPlan:
    """One bundle per named host, pinned to its node, with that host's ranks in order."""
    per_worker = layout.worker_resources()
    bundles, worker_bundles = [], []
    for index, (_, slots) in enumerate(layout.hosts):
        bundles.append({name: amount * slots for name, amount in per_worker.items()})
        worker_bundles.extend([index] * slots)
    return PlacementPlan(tuple(bundles), "PACK", tuple(worker_bundles), tuple(node_ids))


def plan_existing_group(
    layout: WorkerLayout, bundle_specs: Sequence[dict[str, float]]
) -> PlacementPlan:
    """Places ``layout``'s workers in an existing group with ``bundle_specs``.

    With ``num_hosts``, worker ``i`` takes bundle ``i // num_workers_per_host``; with
    ``num_workers``, Ray picks a bundle with room; with neither, each bundle holds as many
    workers as its resources allow.

    Raises:
        ConfigError: The group has too few bundles, or no room for a single worker.
    """
    if layout.num_workers is not None:
        return PlacementPlan((), "", (ANY_BUNDLE,) * layout.num_workers)
    if layout.num_hosts is not None:
        if layout.num_hosts > len(bundle_specs):
            raise ConfigError(
                "num_hosts",
                f"num_hosts={layout.num_hosts} but the current placement group has only "
                f"{len(bundle_specs)} bundle(s); lower num_hosts or pass "
                f"use_current_placement_group=False",
            )
        slots = layout.num_workers_per_host
        return PlacementPlan((), "", tuple(i // slots for i in range(layout.num_hosts * slots)))
    per_worker = layout.worker_resources()
    worker_bundles: list[int] = []
    for index, spec in enumerate(bundle_specs):
        fits = min(math.floor(spec.get(name, 0) / need + 1e-9) for name, need in per_worker.items())
        worker_bundles.extend([index] * fits)
    if not worker_bundles:
        raise ConfigError(
            "cpus_per_worker",
            f"no bundle of the current placement group ({list(bundle_specs)}) fits one worker "
            f"needing {per_worker}; lower cpus_per_worker or give num_workers",
        )
    return PlacementPlan((), "", tuple(worker_bundles))


def current_group(layout: WorkerLayout) -> PlacementGroup | None:
    """The placement group this process runs in, if the layout may use it."""
    if not layout.use_current_placement_group:
        return None
    return ray.util.get_current_placement_group()


def reserve(
    plan: PlacementPlan, timeout_s: float, check: Callable[[], None] = lambda: None
) -> PlacementGroup:
    """Creates the plan's placement group and waits until Ray has reserved it.

    Args:
        plan: What to reserve.
        timeout_s: Longest wait.
        check: Called every ~0.1 s while waiting; whatever it raises ends the wait.

    Raises:
        PlacementTimeoutError: Not reserved within ``timeout_s``. The group is removed,
            as it is when the wait is interrupted or ``check`` raises.
    """
    selectors = [{NODE_ID_LABEL: node_id} for node_id in plan.node_ids] or None
    group = ray.util.placement_group(
        list(plan.bundles), strategy=plan.strategy, bundle_label_selector=selectors
    )
    try:
        not_ready = wait_all([group.ready()], timeout_s, check)
    except BaseException:
        # Ctrl-C or a cancel while waiting: the caller never sees the group to remove it.
        ray.util.remove_placement_group(group)
        raise
    if not not_ready:
        return group
    ray.util.remove_placement_group(group)
    message = timeout_message(plan, timeout_s, ray.available_resources(), ray.cluster_resources())
    raise PlacementTimeoutError(message)


def timeout_message(
    plan: PlacementPlan,
    timeout_s: float,
    available: Mapping[str, float],
    total: Mapping[str, float],
) -> str:
    """Why a plan was not reserved in time: what it asked, what the cluster has. Pure."""
    bundle = plan.bundles[0]
    shown = [name for name in ("CPU", "GPU") if name in total or bundle.get(name)]
    # Ray leaves out a resource that is fully used, or that no node has: shown as 0.
    now = {name: available.get(name, 0.0) for name in shown}
    whole = {name: total.get(name, 0.0) for name in shown}
    absent = sorted(name for name, amount in bundle.items() if amount and not total.get(name))
    none_has = (
        f"No node of the cluster has {' or '.join(absent)} (an autoscaler may still add one). "
        if absent
        else ""
    )
    return (
        f"Ray could not reserve {len(plan.bundles)} bundle(s) of {bundle} ({plan.strategy}) "
        f"within placement_group_timeout_s={timeout_s:g}s. Available now: {now}; cluster "
        f"total: {whole}. {none_has}Lower num_workers / cpus_per_worker, add nodes, or raise "
        f"placement_group_timeout_s."
    )
