"""Where an elastic job may run: Ray's node table as horovod's host discovery, and the
request to Ray's autoscaler for the room the job still lacks."""

from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Mapping

import ray
from horovod.runner.elastic.discovery import HostDiscovery

from horovod_ray.layouts import ElasticLayout

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


def addresses_with_room(
    nodes: Iterable[Mapping[str, Any]], per_worker: Mapping[str, float]
) -> set[str]:
    """The addresses of the alive nodes that have room for at least one rank."""
    nodes = list(nodes)
    with_room = node_slots(nodes, per_worker)
    return {n["NodeManagerAddress"] for n in nodes if n["NodeID"] in with_room}


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


class AutoscalerRequest:
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
