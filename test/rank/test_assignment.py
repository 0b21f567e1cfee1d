"""Rank assignment is a pure function: table-driven tests, no Ray."""

from __future__ import annotations

import pytest

from horovod_ray.rank.assignment import RankInfo, WorkerRecord, assign_ranks

pytestmark = pytest.mark.unit  # pure logic: no Ray (make test runs these first)


def _table(node_ids, gpus=None):
    records = [WorkerRecord(n, tuple(gpus[i]) if gpus else ()) for i, n in enumerate(node_ids)]
    return [
        (i.world_rank, i.local_rank, i.local_size, i.cross_rank, i.cross_size)
        for i in assign_ranks(records)
    ]


CASES = {
    "one worker": (["a"], [(0, 0, 1, 0, 1)]),
    "two on one node": (["a", "a"], [(0, 0, 2, 0, 1), (1, 1, 2, 0, 1)]),
    "one per node": (["a", "b", "c"], [(0, 0, 1, 0, 3), (1, 0, 1, 1, 3), (2, 0, 1, 2, 3)]),
    # The docstring's worked example.
    "interleaved start order": (
        ["a", "b", "a", "c", "a"],
        [(0, 0, 3, 0, 3), (3, 0, 1, 1, 3), (1, 1, 3, 0, 1), (4, 0, 1, 2, 3), (2, 2, 3, 0, 1)],
    ),
    "two by two": (
        ["a", "b", "b", "a"],
        [(0, 0, 2, 0, 2), (2, 0, 2, 1, 2), (3, 1, 2, 1, 2), (1, 1, 2, 0, 2)],
    ),
}


@pytest.mark.parametrize("node_ids,expected", CASES.values(), ids=CASES.keys())
def test_rank_table(node_ids, expected):
    assert _table(node_ids) == expected


def test_uneven_nodes_5_4_3():
    nodes = ["a"] * 5 + ["b"] * 4 + ["c"] * 3
    infos = assign_ranks([WorkerRecord(n) for n in nodes])
    assert [i.world_rank for i in infos] == list(range(12))
    assert [i.local_rank for i in infos] == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert [i.local_size for i in infos] == [5] * 5 + [4] * 4 + [3] * 3
    # Local ranks 0-2 exist on all three nodes, 3 on two, 4 on one.
    assert [i.cross_size for i in infos] == [3, 3, 3, 2, 1, 3, 3, 3, 2, 3, 3, 3]
    assert [i.cross_rank for i in infos] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2]
    assert all(i.world_size == 12 for i in infos)


def test_world_ranks_are_contiguous_per_node_whatever_the_order():
    nodes = ["x", "y", "z", "y", "x", "z", "z"]
    infos = assign_ranks([WorkerRecord(n) for n in nodes])
    by_node: dict[str, list[int]] = {}
    for info in infos:
        by_node.setdefault(info.node_id, []).append(info.world_rank)
    for ranks in by_node.values():
        assert sorted(ranks) == list(range(min(ranks), min(ranks) + len(ranks)))
    assert sorted(i.world_rank for i in infos) == list(range(len(nodes)))


def test_node_workers_share_sorted_unique_gpu_ids():
    records = [
        WorkerRecord("a", ("10",)),
        WorkerRecord("b", ("0",)),
        WorkerRecord("a", ("2",)),
        WorkerRecord("a", ("2",)),  # a fractional GPU shared by two workers
    ]
    infos = assign_ranks(records)
    assert [i.visible_gpus for i in infos] == [("2", "10"), ("0",), ("2", "10"), ("2", "10")]
    assert infos[0].env()["CUDA_VISIBLE_DEVICES"] == "2,10"
    assert "CUDA_VISIBLE_DEVICES" not in assign_ranks([WorkerRecord("a")])[0].env()


def test_env_names_every_horovod_variable():
    env = RankInfo(3, 8, 1, 2, 1, 4, "node-1").env()
    assert env == {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "8",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "4",
        "HOROVOD_HOSTNAME": "node-1",
    }


def test_no_records_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        assign_ranks([])
