"""Where an elastic job may run: Ray's node table as horovod's host discovery (less the
nodes Ray is draining, narrowed, if the user gives one, by their own discovery's hosts).
The autoscaler is asked for the room the job still lacks in ``demand``."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping

import ray
from horovod.runner.elastic.discovery import HostDiscovery

from horovod_ray.job import draining
from horovod_ray.job.placement import nodes_named

logger = logging.getLogger(__name__)


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


def staying(nodes: Iterable[Mapping[str, Any]], leaving: Iterable[str]) -> list[dict]:
    """Ray's node table less the nodes in ``leaving`` (draining: they go soon). Pure."""
    leaving = set(leaving)
    return [dict(n) for n in nodes if n.get("NodeID") not in leaving]


def addresses_with_room(
    nodes: Iterable[Mapping[str, Any]], per_worker: Mapping[str, float]
) -> set[str]:
    """The addresses of the alive nodes that have room for at least one rank."""
    nodes = list(nodes)
    with_room = node_slots(nodes, per_worker)
    return {n["NodeManagerAddress"] for n in nodes if n["NodeID"] in with_room}


def narrow(
    slots: Mapping[str, int],
    wanted: Mapping[str, int | None],
    nodes: Iterable[Mapping[str, Any]],
    driver_node_id: str,
) -> tuple[dict[str, int], list[str]]:
    """Ray's slots per node, narrowed to the hosts a user's discovery named. Pure.

    Args:
        slots: Node id -> the ranks its room holds (:func:`node_slots`).
        wanted: Host -> slots (None: as many as there is room for), a host being a
            node's address, host name or id, or ``localhost`` (the driver's node).
        nodes: Ray's node table.
        driver_node_id: The driver's node.

    Returns:
        Node id -> the fewer of the two counts, for nodes named and with room; and the
        hosts that name no node (or several), which are left out.
    """
    nodes = list(nodes)
    narrowed, unknown = {}, []
    for host, count in wanted.items():
        found = nodes_named(host, nodes, driver_node_id)
        if len(found) != 1:
            unknown.append(host)
            continue
        room = slots.get(found[0], 0)
        fits = room if count is None else min(room, count)
        if fits > 0:
            narrowed[found[0]] = fits
    return narrowed, unknown


class NodeDiscovery(HostDiscovery):
    """horovod's host discovery over Ray's node table, read at most every ``interval_s``.

    A node that Ray drains is left out from then on: horovod's driver sees its host
    removed and tells the ranks at their next ``commit()``, so the job re-forms without it
    before it dies, rolling nothing back. With ``hosts`` (the user's ``HostDiscovery``,
    asked as often), only the nodes it names are used, each with at most the slots it gives.
    """

    def __init__(
        self,
        per_worker: Mapping[str, float],
        only_ip: str | None,
        interval_s: float,
        hosts: HostDiscovery | None = None,
        on_leaving: Callable[[str, int | None], None] | None = None,
    ) -> None:
        super().__init__()
        self._per_worker = dict(per_worker)
        self._only_ip = only_ip
        self._interval_s = interval_s
        self._hosts = hosts
        self._driver_node_id = ray.get_runtime_context().get_node_id()
        self._unknown: set[str] = set()
        self._drained: set[str] = set()
        # Told of each draining node the job used, with its deadline (ms since the epoch;
        # None: none given), before horovod's driver learns the node is gone.
        self._on_leaving = on_leaving
        self._last: tuple[float, dict[str, int]] = (-float("inf"), {})

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        read_at, slots = self._last
        if time.monotonic() - read_at >= self._interval_s:
            nodes = ray.nodes()
            self._note_draining(draining.draining_nodes(), slots)
            slots = node_slots(staying(nodes, self._drained), self._per_worker, self._only_ip)
            if self._hosts is not None:
                # Names are matched against every node, draining ones included.
                wanted = self._hosts.find_available_hosts_and_slots()
                slots, unknown = narrow(slots, wanted, nodes, self._driver_node_id)
                for host in sorted(set(unknown) - self._unknown):
                    logger.info("elastic job: discovered host %r is no single Ray node", host)
                self._unknown.update(unknown)
            self._last = (time.monotonic(), slots)
        return dict(slots)

    def drained(self, node_id: str) -> bool:
        """Whether the node was seen draining (and so left out from then on)."""
        return node_id in self._drained

    def _note_draining(self, leaving: Mapping[str, float], used: Mapping[str, int]) -> None:
        """Keeps the draining nodes (a failed read, which gives none, forgets none), and
        says so once for each that the job was using."""
        for node_id in sorted(set(leaving) & set(used) - self._drained):
            logger.info(
                "elastic job: node %s is draining (%s): its ranks leave at their next commit()",
                node_id[:12],
                draining.describe(leaving[node_id]),
            )
            if self._on_leaving is not None:
                self._on_leaving(
                    node_id, draining.deadline_ms({node_id: leaving[node_id]}, time.time())
                )
        self._drained.update(leaving)
