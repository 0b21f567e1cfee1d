"""horovod.ray's ``RayHostDiscovery``: Ray's alive nodes as horovod's hosts, each with the
ranks its resources hold."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import ray
from horovod.runner.elastic.discovery import HostDiscovery


def hosts_and_slots(
    nodes: Iterable[Mapping[str, Any]], cpus_per_slot: float, gpus_per_slot: float | None
) -> dict[str, int]:
    """Slots per alive Ray node, from its total resources (horovod.ray's count), keyed by
    the node's address, or by its node id where several nodes share an address (Ray
    nodes started on one machine). Pure."""
    alive = [node for node in nodes if node.get("Alive")]
    addresses = [node["NodeManagerAddress"] for node in alive]
    slots = {}
    for node in alive:
        resources = node.get("Resources", {})
        count = resources.get("CPU", 0) // cpus_per_slot
        if gpus_per_slot:
            count = min(count, resources.get("GPU", 0) // gpus_per_slot)
        address = node["NodeManagerAddress"]
        host = address if addresses.count(address) == 1 else node["NodeID"]
        if math.ceil(count) > 0:
            slots[host] = int(math.ceil(count))
    return slots


class RayHostDiscovery(HostDiscovery):
    """horovod.ray's discovery of Ray's nodes: host -> the ranks its resources hold.
    Subclass it to narrow the hosts (``ElasticRayExecutor(override_discovery=False)``
    with ``settings.discovery`` set to the subclass).

    Args:
        use_gpu: Count GPU slots too (a node's slots are the fewer of the two).
        cpus_per_slot: CPUs one rank takes.
        gpus_per_slot: GPUs one rank takes with ``use_gpu``.
    """

    def __init__(
        self, use_gpu: bool = False, cpus_per_slot: float = 1, gpus_per_slot: float = 1
    ) -> None:
        super().__init__()
        self.use_gpu = use_gpu
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = gpus_per_slot

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        gpus = self.gpus_per_slot if self.use_gpu else None
        return hosts_and_slots(ray.nodes(), self.cpus_per_slot, gpus)
