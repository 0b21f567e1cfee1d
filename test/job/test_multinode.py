"""Placement and ranks across several Ray nodes (ray.cluster_utils.Cluster), with real
Horovod collectives: the ranks Horovod reports must be the ones the executor assigned."""

from __future__ import annotations

import pytest

from horovod_ray import PlacementTimeoutError, RayExecutor
from test.conftest import start_cluster, stop_ray
from test.test_executor import horovod_identity

pytestmark = pytest.mark.timeout(240)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


@pytest.fixture(scope="module")
def uneven_cluster():
    """Three nodes with 3, 2 and 1 CPUs."""
    cluster = start_cluster([3, 2, 1])
    yield cluster
    stop_ray()


def _check_consistent(results, executor):
    by_node: dict[str, list[int]] = {}
    for result in results:
        by_node.setdefault(result["node_id"], []).append(result["rank"])
    for ranks in by_node.values():  # contiguous per node
        assert ranks == list(range(ranks[0], ranks[0] + len(ranks)))
    for result, info in zip(results, executor.ranks, strict=True):
        assert (result["rank"], result["local_rank"], result["local_size"]) == (
            info.world_rank,
            info.local_rank,
            info.local_size,
        )
        assert (result["cross_rank"], result["cross_size"]) == (info.cross_rank, info.cross_size)
        assert result["env"]["HOROVOD_HOSTNAME"] == result["node_id"] == info.node_id
    size = len(results)
    assert {r["sum"] for r in results} == {size * (size + 1) / 2}
    return by_node


def test_packed_workers_spill_over_uneven_nodes(uneven_cluster):
    with RayExecutor(SETTINGS, num_workers=6) as executor:
        results = executor.run(horovod_identity)
        by_node = _check_consistent(results, executor)
    assert sorted(len(ranks) for ranks in by_node.values()) == [1, 2, 3]
    # Local rank 0 exists on all three nodes, local rank 2 on one only.
    cross = {(r["local_rank"], r["cross_size"]) for r in results}
    assert cross == {(0, 3), (1, 2), (2, 1)}


def test_one_rank_per_host_is_strictly_spread(uneven_cluster):
    with RayExecutor(SETTINGS, num_hosts=3, num_workers_per_host=1) as executor:
        assert executor.placement_group.bundle_specs == [{"CPU": 1.0}] * 3
        results = executor.run(horovod_identity)
        by_node = _check_consistent(results, executor)
    assert len(by_node) == 3
    assert [(r["local_size"], r["cross_rank"], r["cross_size"]) for r in results] == [
        (1, 0, 3),
        (1, 1, 3),
        (1, 2, 3),
    ]


def test_two_slots_per_host_on_two_hosts(uneven_cluster):
    with RayExecutor(SETTINGS, num_hosts=2, num_workers_per_host=2) as executor:
        results = executor.run(horovod_identity)
        by_node = _check_consistent(results, executor)
    assert [len(ranks) for ranks in by_node.values()] == [2, 2]


def test_more_hosts_than_nodes_times_out(uneven_cluster):
    settings = RayExecutor.create_settings(placement_group_timeout_s=1)
    with pytest.raises(PlacementTimeoutError, match="STRICT_SPREAD"):
        RayExecutor(settings, num_hosts=4).start()
