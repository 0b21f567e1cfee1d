"""Rank arithmetic: which worker gets which world, local and cross rank. Pure, no Ray.

Horovod wants world ranks contiguous per host: the workers of one host hold ranks
``k, k+1, ...`` and number themselves ``0..local_size-1`` locally. Workers with the same
local rank form a "cross" communicator over the hosts that have such a worker.

Worked example: five workers started in the order node ids ``a, b, a, c, a``::

    worker:      0  1  2  3  4
    node:        a  b  a  c  a
    world_rank:  0  3  1  4  2      (node a first: it appeared first)
    local_rank:  0  0  1  0  2
    local_size:  3  1  3  1  3
    cross_rank:  0  1  0  2  0      (local rank 0 exists on a, b, c; 1 and 2 on a only)
    cross_size:  3  3  1  3  1

This is where a static job's ranks are numbered. An elastic job's ranks are numbered by
horovod's own elastic driver (its host assignment, for each world); ``elastic_driver``
turns each of its slots into the same :class:`RankInfo` at the edge, with the node's GPUs
gathered by ``bringup.NodeGpus`` as :func:`visible_gpus` does here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence


@dataclasses.dataclass(frozen=True)
class WorkerRecord:
    """What a started worker reports about where it runs.

    Attributes:
        node_id: The Ray node id (the host identity; hostnames may repeat).
        gpu_ids: The GPU ids Ray assigned to this worker (empty without GPUs).
    """

    node_id: str
    gpu_ids: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """The Horovod identity of one worker."""

    world_rank: int
    world_size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    node_id: str
    visible_gpus: tuple[str, ...] = ()

    def env(self) -> dict[str, str]:
        """The HOROVOD_* variables that identify this rank to Horovod."""
        env = {
            "HOROVOD_RANK": str(self.world_rank),
            "HOROVOD_SIZE": str(self.world_size),
            "HOROVOD_LOCAL_RANK": str(self.local_rank),
            "HOROVOD_LOCAL_SIZE": str(self.local_size),
            "HOROVOD_CROSS_RANK": str(self.cross_rank),
            "HOROVOD_CROSS_SIZE": str(self.cross_size),
            "HOROVOD_HOSTNAME": self.node_id,
        }
        if self.visible_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_gpus)
        return env


def _gpu_sort_key(gpu_id: str) -> tuple[int, int, str]:
    # Numeric ids sort as numbers ("2" before "10"); anything else (UUIDs) after, as text.
    return (0, int(gpu_id), "") if gpu_id.isdigit() else (1, 0, gpu_id)


def visible_gpus(gpu_ids: Iterable[Iterable[str]]) -> tuple[str, ...]:
    """What every rank of a node sees: the sorted, unique GPU ids of the node's ranks."""
    return tuple(sorted({gpu for ids in gpu_ids for gpu in ids}, key=_gpu_sort_key))


def assign_ranks(records: Sequence[WorkerRecord]) -> list[RankInfo]:
    """Assigns Horovod ranks to workers, grouping them by node.

    Nodes are ordered by their first worker in ``records``; within a node workers keep
    their order. Every worker on a node sees the same ``visible_gpus``: the sorted, unique
    GPU ids of all the node's workers, so that local rank ``i`` can use GPU ``i``.

    Args:
        records: One record per worker, in the order the workers were started.

    Returns:
        One RankInfo per worker, in the same order as ``records`` (not in rank order).

    Raises:
        ValueError: ``records`` is empty.
    """
    if not records:
        raise ValueError("assign_ranks needs at least one worker record")
    by_node: dict[str, list[int]] = {}
    for index, record in enumerate(records):
        by_node.setdefault(record.node_id, []).append(index)

    # cross_ranks[local_rank] lists, in node order, the nodes that have that local rank.
    max_local = max(len(indices) for indices in by_node.values())
    cross_nodes = [
        [node for node, indices in by_node.items() if len(indices) > local_rank]
        for local_rank in range(max_local)
    ]

    infos: list[RankInfo | None] = [None] * len(records)
    world_rank = 0
    for node, indices in by_node.items():
        visible = visible_gpus(records[i].gpu_ids for i in indices)
        for local_rank, index in enumerate(indices):
            peers = cross_nodes[local_rank]
            infos[index] = RankInfo(
                world_rank=world_rank,
                world_size=len(records),
                local_rank=local_rank,
                local_size=len(indices),
                cross_rank=peers.index(node),
                cross_size=len(peers),
                node_id=node,
                visible_gpus=visible,
            )
            world_rank += 1
    return [info for info in infos if info is not None]


def membership_change(
    before: Sequence[RankInfo], after: Sequence[RankInfo], reset: int
) -> dict[str, Any]:
    """What changed between two worlds, as the dict the callbacks get.

    A slot is a (node, local rank) pair: ``ranks_removed`` are the old world's ranks of
    slots that are gone, ``ranks_added`` the new world's ranks of slots that are new.
    """
    old = {(rank.node_id, rank.local_rank): rank.world_rank for rank in before}
    new = {(rank.node_id, rank.local_rank): rank.world_rank for rank in after}
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
