"""Placement and ranks across several Ray nodes (ray.cluster_utils.Cluster), with real
Horovod collectives: the ranks Horovod reports must be the ones the executor assigned."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.fs
import pytest
import ray
from ray.cluster_utils import Cluster

import horovod_ray
from horovod_ray import NodeDrainingError, PlacementTimeoutError, RayExecutor
from test.checkpointed_training import steps_told_of_drains
from test.conftest import doc_blocks, shut_down_own_ray, start_cluster
from test.test_executor import horovod_identity

pytestmark = pytest.mark.timeout(240)

SETTINGS = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=30)


@pytest.fixture(scope="module")
def uneven_cluster():
    """Three nodes with 3, 2 and 1 CPUs."""
    cluster = start_cluster([3, 2, 1])
    yield cluster
    shut_down_own_ray()


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
        _replace_node(self._cluster, self.node_id)


def _replace_node(cluster: Cluster, node_id: str | None) -> None:
    """Puts a fresh node with the same CPUs in place of ``node_id`` (a drained node exits
    once nothing runs on it; the module's next tests want the cluster as it was)."""
    for node in [n for n in cluster.worker_nodes if n.node_id == node_id]:
        cpus = node._ray_params.num_cpus  # noqa: SLF001 - the spec it was added with
        cluster.remove_node(node)
        cluster.add_node(num_cpus=cpus)


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


def test_a_static_job_told_of_a_drain_resumes_with_no_step_done_twice(uneven_cluster, tmp_path):
    """Ray Train's just-in-time checkpoint in a static job: every rank is told of the drain
    (get_preemption_info(), rank 0's answer on each: its deadline and the ranks on the
    node), rank 0 commits the checkpoint it reports then, the job stops at once (not at
    the deadline), and run(max_restarts=1) starts again from that checkpoint on the nodes
    that stay: each step is done once."""
    preemption = _Preemption(uneven_cluster, tmp_path, 2)
    began = time.time()
    try:
        results = horovod_ray.run(
            steps_told_of_drains,
            args=(str(tmp_path),),
            num_hosts=2,
            num_slots=1,
            max_restarts=1,
            storage_path=str(tmp_path / "store"),
            name="run",
        )
        assert not (tmp_path / "finish").exists()  # the first attempt did not run out
    finally:
        preemption.end()
    assert [r["attempt"] for r in results] == [1, 1]
    assert preemption.node_id not in {r["node"] for r in results}
    assert [r["notices"] for r in results] == [[], []]  # the new nodes are not draining
    _check_resumed_once(tmp_path, preemption.node_id, began)


def test_a_command_lines_ranks_resume_a_drain_with_no_step_done_twice(uneven_cluster, tmp_path):
    """The same under ``horovod-ray run --max-restarts 1``, on TensorFlow: the command's
    ranks are told through their actors, and the restarted command resumes."""
    script = Path(__file__).parent.parent / "scripts" / "checkpointed.py"
    preemption = _Preemption(uneven_cluster, tmp_path, 2)
    began = time.time()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "horovod_ray", "run", "--address", uneven_cluster.address,
             "--num-hosts", "2", "--storage-path", str(tmp_path / "store"), "--name", "run",
             "--max-restarts", "1", sys.executable, str(script), "drains", str(tmp_path),
             "tensorflow"],
            capture_output=True, text=True, timeout=180, cwd=tmp_path,
        )  # fmt: skip
        assert not (tmp_path / "finish").exists()
    finally:
        preemption.end()
    assert out.returncode == 0, out.stderr[-3000:]
    assert "which Ray is draining (deadline in" in out.stderr
    ends = [
        json.loads(line.split(":", 1)[1]) for line in out.stdout.splitlines() if '"attempt"' in line
    ]
    assert sorted((end["attempt"], end["rank"]) for end in ends) == [(1, 0), (1, 1)]
    _check_resumed_once(tmp_path, preemption.node_id, began)


def _check_resumed_once(folder: Path, drained: str, began: float) -> None:
    """Rank 0 did each step once over both attempts, 5 of them in the restarted one, from
    the checkpoint reported on the notice; both ranks of the first attempt were given one
    notice, rank 0's, naming the drained node's ranks and docs/cloud.rst's 120 s deadline."""
    done = [tuple(map(int, line.split())) for line in (folder / "done").read_text().splitlines()]
    steps = [step for _, step in done]
    assert steps == list(range(1, len(steps) + 1)), done  # none twice, none skipped
    assert [attempt for attempt, _ in done[-5:]] == [1] * 5 and done[-6][0] == 0
    result = horovod_ray.Result.from_path(str(folder / "store" / "run"))
    assert result.metrics["step"] == done[-6][1]  # the checkpoint it resumed from
    seen = {(folder / f"notice.0.{rank}").read_text() for rank in (0, 1)}
    assert len(seen) == 1 and not list(folder.glob("notice.1.*"))
    deadline_ms, nodes = json.loads(seen.pop())
    there = [r for r in (0, 1) if (folder / f"started.{r}").read_text() == drained]
    assert nodes == {drained: there}
    assert began + 100 < deadline_ms / 1000 < time.time() + 120


class _SlowUploads(pyarrow.fs.FileSystemHandler):
    """The local filesystem, where writing a file of a checkpoint's folder takes
    ``delay_s`` (a slow object store); ``flags/uploading`` says one has begun."""

    def __init__(self, flags: str, delay_s: float) -> None:
        self.flags, self.delay_s = flags, delay_s
        self._local = pyarrow.fs.LocalFileSystem()

    def open_output_stream(self, path, metadata):
        if re.search(r"/checkpoint_\d+/", path):
            Path(self.flags, "uploading").touch()
            time.sleep(self.delay_s)
        return self._local.open_output_stream(path, metadata=metadata)

    def get_type_name(self):
        return "slow-uploads"

    def normalize_path(self, path):
        return self._local.normalize_path(path)

    def get_file_info(self, paths):
        return self._local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self._local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self._local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self._local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not on this test's filesystem")

    def delete_file(self, path):
        self._local.delete_file(path)

    def move(self, src, dest):
        self._local.move(src, dest)

    def copy_file(self, src, dest):
        self._local.copy_file(src, dest)

    def open_input_stream(self, path):
        return self._local.open_input_stream(path)

    def open_input_file(self, path):
        return self._local.open_input_file(path)

    def open_append_stream(self, path, metadata):
        return self._local.open_append_stream(path, metadata=metadata)


def _report_then_wait_for_finish(folder: str) -> None:
    """Rank 0 reports a checkpoint (its upload goes on beside); every rank then waits for
    ``folder/finish``."""
    import tempfile

    from ray.train import Checkpoint

    if int(os.environ["HOROVOD_RANK"]) == 0:
        with tempfile.TemporaryDirectory() as directory:
            Path(directory, "state.json").write_text("{}")
            horovod_ray.report({"step": 1}, checkpoint=Checkpoint.from_directory(directory))
    while not Path(folder, "finish").exists():
        time.sleep(0.1)


def test_a_drain_elsewhere_lets_rank_0_commit_its_upload_before_the_job_stops(
    uneven_cluster, tmp_path
):
    """Rank 0 on the driver's node has a checkpoint upload in flight (8 s) when Ray drains
    rank 1's node (deadline in 120 s): the job still stops with NodeDrainingError, but only
    once the upload is committed, well within the deadline (before, rank 0 was killed
    mid-upload, and the checkpoint was lost: no marker, its folder pruned)."""
    head = ray.get_runtime_context().get_node_id()
    other = next(n.node_id for n in uneven_cluster.worker_nodes if n.node_id != head)
    (tmp_path / "flags").mkdir()
    storage = pyarrow.fs.PyFileSystem(_SlowUploads(str(tmp_path / "flags"), delay_s=8))
    settings = RayExecutor.create_settings(
        timeout_s=60,
        placement_group_timeout_s=30,
        storage_path=str(tmp_path / "store"),
        name="run",
        storage_filesystem=storage,
    )
    executor = RayExecutor(settings, hosts=[("localhost", 1), (other, 1)])
    executor.start()
    drained = threading.Event()

    def drain_once_uploading() -> None:
        deadline = time.monotonic() + 120
        while not (tmp_path / "flags" / "uploading").exists():
            if time.monotonic() > deadline:
                (tmp_path / "finish").touch()  # no upload began: let the job end
                return
            time.sleep(0.1)
        _drain_as_the_docs_say(uneven_cluster.address, other)
        drained.set()

    drainer = threading.Thread(target=drain_once_uploading, daemon=True)
    drainer.start()
    try:
        with pytest.raises(NodeDrainingError) as raised:
            executor.run(_report_then_wait_for_finish, args=(str(tmp_path),))
    finally:
        (tmp_path / "finish").touch()
        executor.stop()
        drainer.join(90)
        _replace_node(uneven_cluster, other)
    assert drained.is_set()
    assert list(raised.value.failures) == [1]
    run = tmp_path / "store" / "run"
    assert (run / "checkpoint_000001.json").exists(), sorted(p.name for p in run.iterdir())
    assert (run / "checkpoint_000001" / "state.json").read_text() == "{}"
