"""Placement and ranks across several Ray nodes (ray.cluster_utils.Cluster), with real
Horovod collectives: the ranks Horovod reports must be the ones the executor assigned."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import horovod_ray
from horovod_ray import NodeDrainingError, PlacementTimeoutError, RayExecutor
from test.conftest import doc_blocks, start_cluster, stop_ray
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


def _wait_for_finish(folder: str) -> tuple[int, str, int]:
    """(attempt, node, rank). The first attempt writes ``started.<rank>`` (its node id) and
    waits for ``folder/finish``; a restarted one returns at once."""
    node = ray.get_runtime_context().get_node_id()
    rank = int(os.environ["HOROVOD_RANK"])
    if horovod_ray.attempt() == 0:
        Path(folder, f"started.{rank}").write_text(node)
        while not Path(folder, "finish").exists():
            time.sleep(0.1)
    return horovod_ray.attempt(), node, rank


def _drain_as_the_docs_say(address: str, node_id: str) -> None:
    """docs/cloud.rst's ``ray drain-node`` command, for this cluster and node."""
    (block,) = [b for b in doc_blocks("bash") if b.startswith("ray drain-node ")]
    command = block.replace("\\\n", " ").replace("HEAD:6379", address)
    words = shlex.split(command.replace("NODE_ID", node_id))
    ray_cli = Path(sys.executable).parent / "ray"
    subprocess.run([str(ray_cli), *words[1:]], check=True, capture_output=True, timeout=60)


class _Preemption:
    """Once every rank has started, drains the node of a rank off the driver's node (a
    cloud's preemption notice, 120 s ahead, by docs/cloud.rst's command); lets the ranks
    finish 60 s later whatever happened, so a job that does not react returns instead of
    hanging."""

    def __init__(self, cluster: Cluster, folder: Path, num_ranks: int) -> None:
        self.node_id: str | None = None
        self._cluster, self._folder, self._num_ranks = cluster, folder, num_ranks
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            head = ray.get_runtime_context().get_node_id()
            deadline = time.monotonic() + 120
            while len(list(self._folder.glob("started.*"))) < self._num_ranks:
                if time.monotonic() > deadline or self._ended.wait(0.1):
                    return
            nodes = {p.read_text() for p in self._folder.glob("started.*")}
            self.node_id = sorted(nodes - {head})[0]  # replaced at the end, drained or not
            _drain_as_the_docs_say(self._cluster.address, self.node_id)
            self._ended.wait(60)
        finally:
            (self._folder / "finish").touch()

    def end(self) -> None:
        """Lets the ranks finish, then puts a fresh node in place of the drained one (the
        drained node exits once nothing runs on it)."""
        self._ended.set()
        self._thread.join(90)  # longer than the drain command may take
        for node in [n for n in self._cluster.worker_nodes if n.node_id == self.node_id]:
            cpus = node._ray_params.num_cpus  # noqa: SLF001 - the spec it was added with
            self._cluster.remove_node(node)
            self._cluster.add_node(num_cpus=cpus)


def test_a_static_job_on_a_draining_node_stops_at_once_naming_it(uneven_cluster, tmp_path):
    """A static job cannot leave a node: when Ray drains one of its nodes it stops then,
    with NodeDrainingError naming the ranks there, not when the node dies."""
    executor = RayExecutor(SETTINGS, num_hosts=2, num_workers_per_host=1)
    executor.start()
    preemption = _Preemption(uneven_cluster, tmp_path, 2)
    try:
        ranks = {info.world_rank: info.node_id for info in executor.ranks}
        with pytest.raises(NodeDrainingError) as raised:
            executor.run(_wait_for_finish, args=(str(tmp_path),))
        assert not (tmp_path / "finish").exists()  # stopped before the ranks were let go
    finally:
        executor.stop()
        preemption.end()
    there = [rank for rank, node in ranks.items() if node == preemption.node_id]
    assert list(raised.value.failures) == there
    text = str(raised.value)
    assert f"on node {preemption.node_id[:12]}" in text
    assert "which Ray is draining (deadline in" in text and "max_restarts" in text


def test_run_with_restarts_starts_again_off_a_draining_node(uneven_cluster, tmp_path):
    """run(max_restarts=1): the attempt on a draining node is stopped, and the next one
    is placed on the nodes that stay."""
    preemption = _Preemption(uneven_cluster, tmp_path, 2)
    try:
        results = horovod_ray.run(
            _wait_for_finish, args=(str(tmp_path),), num_hosts=2, num_slots=1, max_restarts=1
        )
        assert not (tmp_path / "finish").exists()
    finally:
        preemption.end()
    assert [attempt for attempt, _, _ in results] == [1, 1]
    assert preemption.node_id not in {node for _, node, _ in results}
