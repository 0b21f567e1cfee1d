"""Elastic jobs on a real multi-node Ray cluster: lose a node, grow back, hit the limits."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
from pathlib import Path

import pytest
import ray

import horovod_ray
from horovod_ray import ElasticRayExecutor, RayExecutor
from horovod_ray.elastic import RayHostDiscovery
from horovod_ray.errors import ElasticLimitError, ExecutorStateError
from horovod_ray.rank import logs
from test.autoscaling import alive_worker_nodes, drain_node, standing_request
from test.conftest import same_on_every_rank, shut_down_own_ray, start_cluster
from test.elastic_training import (
    Heard,
    grow_after_a_slow_start,
    progress,
    train,
    train_announced,
    train_keras,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster():
    """A 0-CPU head and three 2-CPU nodes: room for 6 ranks."""
    cluster = start_cluster([0, 2, 2, 2])
    yield cluster
    shut_down_own_ray()


@pytest.fixture
def one_worker_node(cluster):
    """The module's cluster with one worker node of its three (room for 2 ranks); three
    again afterwards, for what comes next."""
    for node in list(cluster.worker_nodes)[1:]:
        cluster.remove_node(node)
    _wait_for(lambda: alive_worker_nodes() == 1, 60, "one worker node")
    yield cluster
    while len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=2)


def _at(folder: Path, step: int, size: int):
    """True once rank 0 has done ``step`` steps and the last one ran on ``size`` ranks."""

    def reached() -> bool:
        done, now = progress(folder)
        return done >= step and now == size

    return reached


def _wait_for(condition, timeout_s: float, what: str, run: _Run | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        if run is not None and not run.thread.is_alive():
            raise AssertionError(f"run() ended while waiting for {what}: {run.outcome}")
        time.sleep(0.2)


class _Run:
    """An elastic run() in a thread, its membership events, and its outcome."""

    def __init__(self, executor: RayExecutor, folder: Path, fn=train, *args) -> None:
        self.heard = Heard()
        self.plain: list[dict] = []  # a horovod.ray callback: log() dicts only
        self.outcome: dict = {}

        def target() -> None:
            try:
                self.outcome["results"] = executor.run(
                    fn, args=(str(folder), *args), callbacks=[self.plain.append, self.heard]
                )
            except BaseException as err:  # noqa: BLE001 - read by the test
                self.outcome["error"] = err

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def ended(self, timeout_s: float) -> None:
        """Waits for run() to end, which it must, without an error."""
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"run() did not end within {timeout_s:g} s"
        assert "error" not in self.outcome, self.outcome.get("error")

    def sizes(self) -> list[int]:
        return [e["size_after"] for e in self.changes()]

    def changes(self) -> list[dict]:
        return list(self.heard.changes)

    def logged(self) -> list[tuple[int, int]]:
        return [(e["step"], e["size"]) for e in self.heard.logs]


def test_node_lost_then_added_training_goes_on(cluster, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="horovod_ray.job.elastic_run")
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, min_workers=2, max_workers=6, elastic_timeout=60)
    executor.start()
    try:
        run = _Run(executor, tmp_path)
        _wait_for(_at(tmp_path, 3, 6), 240, "6 ranks training", run)
        # Every node here has the driver's address: a job kept on the driver's machine
        # asks the autoscaler for nothing (test_autoscaler.py has one that is not).
        assert standing_request() == []
        first = run.changes()[0]
        lost = next(n for n in cluster.worker_nodes if n.node_id in first["nodes_added"])
        cluster.remove_node(lost)
        _wait_for(lambda: min(run.sizes()) <= 4, 120, "the world to shrink", run)
        _wait_for(_at(tmp_path, 1, 4), 120, "training on 4", run)
        shrunk_at = progress(tmp_path)[0]
        _wait_for(_at(tmp_path, shrunk_at + 3, 4), 120, "steps at 4 ranks", run)
        cluster.add_node(num_cpus=2)
        _wait_for(lambda: run.sizes()[-1] == 6 and len(run.sizes()) >= 3, 180, "growth", run)
        grown_at = progress(tmp_path)[0]
        _wait_for(_at(tmp_path, grown_at + 3, 6), 120, "steps at 6 again", run)
        (tmp_path / "finish").touch()
        run.thread.join(120)
        assert "error" not in run.outcome, run.outcome.get("error")
    finally:
        executor.stop()
    # Its record in the GCS (horovod-ray status) counted each new world after the first.
    (job,) = [job for job in horovod_ray.jobs(all=True) if job.id == executor.job_id]
    assert (job.kind, job.state, job.ranks_wanted, job.ranks_alive) == ("elastic", "stopped", 6, 0)
    assert job.resets == len(run.changes()) - 1 >= 2
    results = run.outcome["results"]
    assert [r["rank"] for r in results] == list(range(6))
    assert {r["size"] for r in results} == {6}
    history = results[0]["history"]
    assert all(r["history"] == history for r in results)  # every rank holds one state
    # TorchState kept the model, its optimizer and the ElasticSampler in step: the new
    # ranks took the survivors' weights, and the epochs went on.
    assert all(r["weights"] == results[0]["weights"] for r in results)
    assert {r["epochs"] for r in results} == {results[0]["epochs"]}
    steps = [step for step, _, _ in history]
    assert steps == list(range(len(steps)))  # every step once, rolled back where needed
    sizes = [size for _, size, _ in history]
    assert all(total == size for _, size, total in history)  # the allreduce saw everyone
    assert sizes[0] == 6 and sizes[-1] == 6 and 4 in sizes
    first_four = sizes.index(4)
    assert 6 in sizes[first_four:]  # grew back after running on 4
    changes = [e for e in run.changes() if e["size_before"] != e["size_after"]]
    assert (changes[0]["size_before"], changes[0]["size_after"]) == (0, 6)
    assert lost.node_id in changes[1]["nodes_removed"] and changes[1]["size_after"] <= 4
    assert changes[-1]["size_after"] == 6 and changes[-1]["nodes_added"]
    # Rank 0's log() dicts, whichever rank was 0: one per step and world size.
    logged = run.logged()
    assert len(logged) == len(set(logged)) and {size for _, size in logged} == {4, 6}
    assert run.plain == run.heard.logs  # a plain callable hears no change of membership
    assert max(step for step, _ in logged) == len(steps)
    assert standing_request() == []  # withdrawn at the end
    _wait_for(lambda: _our_actors() == [], 30, "every worker actor gone")
    # The lost node's ranks are named with where they ran, and no survivor ended with them
    # (Gloo aborted one, now and then, before patches/*-gloo-unexpected-message.patch).
    ended = re.findall(
        r"elastic job: rank \d+ on node (\w+) \(.*\), local rank \d ended", caplog.text
    )
    assert set(ended) == {lost.node_id[:12]}, caplog.text


def test_a_draining_node_is_left_at_a_commit_without_a_rollback(cluster, tmp_path, caplog):
    """A node drained with a deadline (a spot preemption announced) is left before it dies:
    its ranks go at the next commit() through horovod's host update, the others go on from
    that commit, and no step is begun twice on any rank (a node killed without notice
    makes the survivors roll back to their last commit and do its step again). One rank
    per node (a slot is a whole 2-CPU node): 3 ranks, then 2."""
    caplog.set_level(logging.INFO, logger="horovod_ray.job")
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(
        settings, min_workers=2, max_workers=3, cpus_per_worker=2, elastic_timeout=60
    )
    executor.start()
    leaving = None
    try:
        run = _Run(executor, tmp_path)
        _wait_for(_at(tmp_path, 3, 3), 240, "3 ranks training", run)
        leaving = run.changes()[0]["nodes_added"][-1]
        drained_at = time.time()
        drain_node(cluster.address, leaving, deadline_s=300)
        _wait_for(lambda: run.sizes()[-1] == 2, 120, "the world to shrink", run)
        shrunk_at = progress(tmp_path)[0]
        _wait_for(_at(tmp_path, shrunk_at + 3, 2), 120, "steps at 2 ranks", run)
        _wait_for((tmp_path / "notice").exists, 60, "the ranks to be told", run)
        (tmp_path / "finish").touch()
        run.thread.join(120)
        assert "error" not in run.outcome, run.outcome.get("error")
    finally:
        executor.stop()
        # The drained node exits once its ranks have left; the next tests want three.
        gone = [n for n in cluster.worker_nodes if n.node_id == leaving]
        for node in gone:
            cluster.remove_node(node)
        while len(cluster.worker_nodes) < 3:
            cluster.add_node(num_cpus=2)
    results = run.outcome["results"]
    assert [r["rank"] for r in results] == [0, 1]
    history = same_on_every_rank(results, "history")
    steps = [step for step, _, _ in history]
    assert steps == list(range(len(steps)))
    sizes = [size for _, size, _ in history]
    assert sizes[0] == 3 and sizes[-1] == 2 and sorted(sizes, reverse=True) == sizes
    for result in results:  # nothing rolled back: each step begun once, on every rank
        assert len(result["begun"]) == len(set(result["begun"])), result["begun"]
    change = next(e for e in run.changes() if e["size_before"] == 3 and e["size_after"] == 2)
    assert change["nodes_removed"] == [leaving]
    assert f"node {leaving[:12]} is draining (deadline in" in caplog.text
    # get_preemption_info() told the ranks which node, with the deadline, the same on each.
    (deadline_ms, nodes), seen = json.loads((tmp_path / "notice").read_text()), set()
    for result in results:
        seen.add(json.dumps(result["notices"]))
    assert seen == {json.dumps([[deadline_ms, nodes]])}
    assert list(nodes) == [leaving] and len(nodes[leaving]) == 1
    assert abs(deadline_ms / 1000 - drained_at - 300) < 5
    # Its ranks left as horovod tells a removed host's ranks to, not as failures.
    assert not re.search(r"elastic job: rank \d+ on node \w+ .* ended", caplog.text), caplog.text


def test_jobs_autoscaler_requests_add_up_and_keep_another_drivers(cluster):
    """Ray's request_resources is one standing request for the whole cluster. Each job's
    demand is added to the other jobs' and to another driver's own request, and taken out
    alone when the job ends; a driver asking again replaces only its own part. (Each job
    replaced the whole request before, and cleared it to [] at its end.)"""
    from ray.autoscaler.sdk import request_resources

    from horovod_ray.job.demand import AutoscalerRequest
    from horovod_ray.job.layouts import ElasticLayout

    cpu, gpu = {"CPU": 1.0}, {"GPU": 1.0}

    def of(*bundles: dict) -> list[str]:  # in any order, 2 being 2.0
        return sorted(json.dumps({k: float(v) for k, v in b.items()}) for b in bundles)

    def request() -> list[str]:
        return of(*standing_request())

    request_resources(bundles=[{"CPU": 2}])  # another driver's
    first = AutoscalerRequest(ElasticLayout(min_workers=1, max_workers=3), cpu)
    second = AutoscalerRequest(ElasticLayout(min_workers=1, max_workers=2), gpu)
    try:
        first.ask()
        assert request() == of({"CPU": 2}, cpu, cpu, cpu)
        second.ask()
        assert request() == of({"CPU": 2}, cpu, cpu, cpu, gpu, gpu)
        first.withdraw()
        assert request() == of({"CPU": 2}, gpu, gpu)
        request_resources(bundles=[{"CPU": 4}])  # the other driver asks anew
        second.withdraw()
        assert request() == of({"CPU": 4})
    finally:
        first.withdraw()
        second.withdraw()
        request_resources(bundles=[])


def test_the_standing_request_is_read_back_from_autoscaler_v2s_constraints(cluster):
    """Autoscaler v2 keeps request_resources' request in the GCS, grouped by shape; the
    job reads it back there as bundles (this suite's autoscaler is v1)."""
    from ray.autoscaler.v2.sdk import request_cluster_resources

    from horovod_ray.job import demand

    address = ray._private.worker.global_worker.gcs_client.address
    shapes = [{"CPU": 1}, {"GPU": 1, "CPU": 2}, {"CPU": 1}]
    request_cluster_resources(address, [{"resources": r, "label_selector": {}} for r in shapes])
    try:
        read = demand._standing_request_v2()
    finally:
        request_cluster_resources(address, [])
    canonical = [json.dumps({k: float(v) for k, v in r.items()}, sort_keys=True) for r in shapes]
    assert sorted(json.dumps(r, sort_keys=True) for r in read) == sorted(canonical), read
    assert demand._standing_request_v2() == []


def test_a_node_that_comes_while_the_ranks_start_is_used(one_worker_node, tmp_path):
    """A node that joins after horovod's driver placed the first ranks but before rank 0
    entered its elastic loop (a slow import, data loading; an autoscaler's node arriving
    then) is used once the loop runs. horovod 0.28.1 told only a coordinator that had
    registered, so the job never grew (it did not on Ray's autoscaler: docs/elastic.rst);
    patches/horovod-0.28.1-elastic-early-host-update.patch tells it when it registers."""
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, min_workers=2, max_workers=4, elastic_timeout=60)
    executor.start()
    try:
        run = _Run(executor, tmp_path, grow_after_a_slow_start)
        _wait_for(lambda: len(list(tmp_path.glob("started.*"))) == 2, 120, "2 ranks", run)
        one_worker_node.add_node(num_cpus=2)
        # horovod's driver reads the hosts every second: the new node is seen, and its
        # news skipped (stock horovod) or kept (patched), while rank 0 waits for "go".
        _wait_for(lambda: alive_worker_nodes() == 2, 60, "the new node")
        time.sleep(5)
        (tmp_path / "go").touch()
        run.ended(240)
    finally:
        executor.stop()
    sizes = run.outcome["results"][0]
    assert sizes[0] == 2 and sizes[-3:] == [4, 4, 4], sizes
    assert [e["size_after"] for e in run.changes()] == [2, 4]


def test_a_node_that_comes_while_a_new_world_forms_is_used(one_worker_node, tmp_path):
    """A node that joins after horovod's driver planned a new world, while that world's
    new ranks still start, is used by the world after it. horovod tells rank 0 once of
    each change of hosts, and rank 0 drops what it hears during its reset
    (``State.on_reset``): the job kept the world of 4 to its end. On Ray's autoscaler,
    which brings nodes one at a time, that is common (test_autoscaler failed so in CI).
    The driver tells rank 0 again while the hosts allow another world."""
    # Gloo's default timeout (120 s): ranks 0 and 1 wait in their reset while nodes come.
    executor = RayExecutor(min_workers=2, max_workers=6, elastic_timeout=60)
    executor.start()
    try:
        (tmp_path / "go").touch()
        run = _Run(executor, tmp_path, grow_after_a_slow_start, 6)
        _wait_for(lambda: len(list(tmp_path.glob("started.*"))) == 2, 120, "2 ranks", run)
        (tmp_path / "hold").touch()  # the next ranks wait before hvd.init(), rank 0 for them
        one_worker_node.add_node(num_cpus=2)
        _wait_for(lambda: len(run.changes()) == 2, 60, "the world of 4 planned", run)
        one_worker_node.add_node(num_cpus=2)
        _wait_for(lambda: alive_worker_nodes() == 3, 60, "the third node")
        time.sleep(5)  # horovod's driver reads the hosts every second and tells rank 0
        (tmp_path / "hold").unlink()
        run.ended(240)
    finally:
        executor.stop()
    sizes = run.outcome["results"][0]
    assert sizes[0] == 2 and sizes[-3:] == [6, 6, 6], sizes
    assert [e["size_after"] for e in run.changes()] == [2, 4, 6]


@pytest.mark.line_2023
def test_keras_training_goes_on_when_a_node_is_lost(cluster, tmp_path):
    """A Keras model in hvd.elastic.KerasState with hvd.DistributedOptimizer: a node is
    lost, the others roll back to the last commit and go on, ranks that join later (their
    optimizer not built yet) start in step; every rank ends with the same weights. Without
    patches/horovod-0.28.1-keras-elastic-state.patch the state cannot read a Keras 3
    optimizer's variables, and on Keras 2 a joining rank's sync waits forever.
    One rank per node (a slot is a whole 2-CPU node): the survivor and the rank that joins
    it on the third node, 3 TensorFlow ranks in all instead of 6."""
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(
        settings, min_workers=2, max_workers=2, cpus_per_worker=2, elastic_timeout=60
    )
    executor.start()
    try:
        run = _Run(executor, tmp_path, train_keras)
        _wait_for(_at(tmp_path, 3, 2), 240, "2 ranks training", run)
        used = set(run.changes()[0]["nodes_added"])
        lost = next(n for n in cluster.worker_nodes if n.node_id in used)
        cluster.remove_node(lost)
        _wait_for(lambda: len(run.changes()) >= 2, 120, "the job to lose the node", run)
        after_loss = progress(tmp_path)[0]
        _wait_for(lambda: progress(tmp_path)[0] >= after_loss + 3, 120, "steps after", run)
        (tmp_path / "finish").touch()
        run.thread.join(120)
        assert "error" not in run.outcome, run.outcome.get("error")
    finally:
        executor.stop()
        cluster.add_node(num_cpus=2)  # three worker nodes again for what comes next
    results = run.outcome["results"]
    assert len(results) == 2  # the survivor and a rank that joined it
    history = results[0]["history"]
    assert all(r["history"] == history for r in results)  # one state, the same weights
    assert [step for step, _, _ in history] == list(range(len(history)))
    assert lost.node_id in run.changes()[1]["nodes_removed"]
    assert len({weights for _, _, weights in history}) == len(history)  # it trained


def _our_actors() -> list:
    from ray.util import state

    return [
        a
        for a in state.list_actors(
            address=ray.get_runtime_context().gcs_address, filters=[("state", "=", "ALIVE")]
        )
        if a.class_name == "Worker"
    ]


# Three 2-CPU worker nodes: 6 slots of 1 CPU, or 3 of 2 (the executor's cpus_per_worker).
@pytest.mark.parametrize(("cpus_per_worker", "wanted", "available"), [(1, 7, 6), (2, 4, 3)])
def test_below_min_workers_fails_with_the_limit_named(cluster, cpus_per_worker, wanted, available):
    executor = RayExecutor(
        min_workers=wanted,
        max_workers=wanted + 1,
        elastic_timeout=3,
        cpus_per_worker=cpus_per_worker,
    )
    executor.start()
    with pytest.raises(ElasticLimitError) as raised:
        executor.run(train, args=("/nonexistent",))
    error = raised.value
    assert (error.limit, error.wanted, error.available) == ("min_workers", wanted, available)
    assert f"min_workers={wanted}" in str(error) and "elastic_timeout=3s" in str(error)
    executor.stop()
    assert standing_request() == []


def test_reset_limit_fails_with_the_limit_named(cluster, tmp_path):
    """Growing is a reset too (as in horovod): a node added to a job with reset_limit=0.
    One rank per node (a slot is a whole 2-CPU node): 3 ranks, then room for a fourth."""
    settings = RayExecutor.create_settings(timeout_s=35)
    executor = RayExecutor(settings, min_workers=2, max_workers=4, cpus_per_worker=2, reset_limit=0)
    executor.start()
    added = None
    try:
        run = _Run(executor, tmp_path)
        _wait_for(_at(tmp_path, 2, 3), 240, "3 ranks training", run)
        # The job's timeout_s reached the elastic run's server: four holds of 8.75 s.
        assert executor._now.kind._current._server._store.hold_s == 8.75
        added = cluster.add_node(num_cpus=2)
        run.thread.join(120)
    finally:
        executor.stop()
        if added is not None:
            cluster.remove_node(added)  # leave three worker nodes for what comes next
    error = run.outcome["error"]
    assert isinstance(error, ElasticLimitError), error
    assert error.limit == "reset_limit" and "reset_limit=0" in str(error)
    _wait_for(lambda: _our_actors() == [], 30, "every worker actor gone")


def test_other_calls_are_refused_on_an_elastic_job(cluster):
    executor = RayExecutor(min_workers=1, max_workers=2)
    executor.start()
    try:
        for call in (
            lambda: executor.execute(lambda _: 1),
            lambda: executor.run_remote(lambda: 1),
            lambda: executor.execute_single(lambda _: 1),
        ):
            with pytest.raises(ExecutorStateError, match="not available on an elastic job"):
                call()
    finally:
        executor.stop()


def test_horovod_rays_elastic_executor_with_its_own_discovery(cluster, tmp_path):
    """horovod's elastic Ray examples as written for horovod.ray, the import changed:
    ElasticRayExecutor, a RayHostDiscovery subclass in settings.discovery with
    override_discovery=False, and a callback; the training holds a TorchState."""
    left_out = sorted(node.node_id for node in cluster.worker_nodes)[0]

    class AllButOne(RayHostDiscovery):
        def find_available_hosts_and_slots(self) -> dict[str, int]:
            hosts = super().find_available_hosts_and_slots()  # node ids: one machine
            return {host: slots for host, slots in hosts.items() if host != left_out}

    (tmp_path / "finish").touch()  # one step
    settings = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=6, verbose=True)
    settings.discovery = AllButOne(cpus_per_slot=1)
    with pytest.warns(DeprecationWarning, match="ElasticRayExecutor is deprecated"):
        executor = ElasticRayExecutor(settings, cpus_per_slot=1, override_discovery=False)
    executor.start()
    heard, plain = Heard(), []
    try:
        results = executor.run(
            functools.partial(train_announced, str(tmp_path)), [plain.append, heard]
        )
    finally:
        executor.shutdown()
    assert [(r["rank"], r["size"]) for r in results] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    (first,) = heard.changes
    assert len(first["nodes_added"]) == 2 and left_out not in first["nodes_added"]
    assert plain == heard.logs  # no change of membership among them
    assert plain.count({"started": True}) == 4  # ray_logger: every rank's
    assert [(e["step"], e["size"]) for e in plain if "step" in e] == [(1, 4)]  # rank 0's


def test_repeated_runs_leak_nothing(cluster, tmp_path):
    """Threads, fds and actors of the driver stay level over repeated elastic runs: a run
    after the first leaves nothing more behind."""
    (tmp_path / "finish").touch()  # one step per run
    # Three ranks, two of them on one node: what a run holds per host, and per rank on a
    # host with another (horovod fills a host's slots before the next host's).
    executor = RayExecutor(min_workers=3, max_workers=3)
    executor.start()

    def footprint() -> tuple[int, dict[int, str]]:
        _wait_for(lambda: _our_actors() == [], 30, "every worker actor gone")
        return threading.active_count(), _open_fds()

    try:
        executor.run(train, args=(str(tmp_path),))  # warms up Ray's own threads and fds
        before = footprint()
        results = executor.run(train, args=(str(tmp_path),))  # what one more run leaves
        assert [(r["rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2), (2, 1)]
        after = footprint()
    finally:
        executor.stop()
    assert after[0] <= before[0], f"threads grew: {before[0]} -> {after[0]}"
    grown = {fd: what for fd, what in after[1].items() if before[1].get(fd) != what}
    assert len(after[1]) <= len(before[1]) + 2, f"fds grew by {len(grown)}: {grown}"
    assert standing_request() == []


def _open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each is (a path, or a socket with its
    addresses), less its connections to the nodes' raylets: Ray opens one to a node the
    first time the driver needs that node (a later run may be the first), and keeps it."""
    import psutil

    raylets = {(n["NodeManagerAddress"], n["NodeManagerPort"]) for n in ray.nodes()}
    sockets, to_raylets = {}, set()
    for c in psutil.Process().net_connections("all"):
        if c.raddr and (c.raddr.ip.removeprefix("::ffff:"), c.raddr.port) in raylets:
            to_raylets.add(c.fd)
        else:
            sockets[c.fd] = f"socket {c.laddr} -> {c.raddr} {c.status}"
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in to_raylets:
            continue
        try:
            fds[fd] = sockets.get(fd) or os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the descriptor listdir itself used, closed since
            pass
    return fds


@ray.remote
class _LastDictInFlight:
    """Rank 0's log channel as a slot saw it in CI: the call's result is ready while the
    poll in flight still holds the call's last dict (it answers half a second later)."""

    def __init__(self) -> None:
        self.polls = 0

    def next_logs(self, call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
        self.polls += 1
        if self.polls == 1:
            time.sleep(0.5)
            return [{"step": 26}], False
        return [], True


def test_a_slot_delivers_the_dict_its_last_poll_holds(cluster):
    """The rank's last log() dict reaches the callbacks even when its call's result is
    seen before the poll that took that dict (CI once lost it: 25 dicts for 26 steps)."""
    channel = _LastDictInFlight.remote()
    seen = []
    assert logs.collect(channel, [ray.put("result")], seen.append, 1, lambda: None) == ["result"]
    assert seen == [{"step": 26}]


@ray.remote(max_concurrency=2)
class _Chatty:
    """A rank 0 that logs faster than the slot checks (every poll answers at once) while
    its call goes on."""

    def next_logs(self, call_id: int, timeout_s: float) -> tuple[list[dict], bool]:
        return [{"step": 1}], False

    def train(self) -> None:
        time.sleep(120)


def test_a_slot_that_is_let_go_ends_its_wait_while_its_rank_logs(cluster):
    """horovod's driver lets a slot go (a reset, a stop): its wait ends even while every
    poll of its rank's log answers before the wait's own timeout."""
    checks = []

    def check():
        checks.append(1)
        if len(checks) >= 5:
            raise TimeoutError("let go")

    chatty = _Chatty.remote()
    try:
        with pytest.raises(TimeoutError, match="let go"):
            logs.collect(chatty, [chatty.train.remote()], lambda _: None, 1, check)
    finally:
        ray.kill(chatty)


def test_stop_ends_a_running_or_waiting_run(cluster, tmp_path):
    """stop() from another thread ends run() (training, or waiting for room) at once."""
    baseline = threading.active_count()
    training = RayExecutor(min_workers=2, max_workers=2, cpus_per_worker=2)  # on 2 nodes
    training.start()
    run = _Run(training, tmp_path)
    _wait_for(_at(tmp_path, 2, 2), 240, "2 ranks training", run)
    training.stop()
    run.thread.join(60)
    assert isinstance(run.outcome.get("error"), ExecutorStateError), run.outcome
    assert "ended by stop()" in str(run.outcome["error"])

    waiting = RayExecutor(min_workers=7, max_workers=8)  # the cluster holds 6
    waiting.start()
    run = _Run(waiting, tmp_path)
    time.sleep(3)
    assert run.thread.is_alive()
    waiting.stop()
    run.thread.join(60)
    assert not run.thread.is_alive() and "ended by stop()" in str(run.outcome["error"])
    _wait_for(lambda: _our_actors() == [], 30, "every worker actor gone")
    _wait_for(lambda: threading.active_count() <= baseline, 30, "no thread left behind")
    assert standing_request() == []


def test_cli_elastic_job_on_discovered_nodes_goes_on_when_one_is_lost(cluster, tmp_path):
    """horovodrun's elastic command line with the binary renamed: the discovery script
    names two of the three nodes (by node id), with 2 and 1 slots, so 3 ranks where
    --max-np allows 4; the 1-slot node is lost mid-run, and the unmodified script goes
    on at 2 ranks and ends with status 0."""
    import subprocess
    import sys

    named = sorted(node.node_id for node in cluster.worker_nodes)[:2]
    (tmp_path / "hosts").write_text(f"{named[0]}:2\n{named[1]}:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    discover.chmod(0o755)
    script = Path(__file__).parent.parent / "scripts" / "elastic_horovod.py"
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "horovod_ray", "run", "--address", cluster.address,
             "--min-np", "2", "--max-np", "4", "--host-discovery-script", str(discover),
             "--elastic-timeout", "60", "--gloo-timeout-seconds", "30",
             "--env", "TF_CPP_MIN_LOG_LEVEL=2", sys.executable, str(script), str(tmp_path)],
            stdout=out, stderr=err,
        )  # fmt: skip
    try:
        running = lambda: process.poll() is None  # noqa: E731
        _wait_for(lambda: _at(tmp_path, 3, 3)() or not running(), 240, "3 ranks training")
        assert running(), (tmp_path / "err").read_text()[-3000:]
        lost = next(node for node in cluster.worker_nodes if node.node_id == named[1])
        cluster.remove_node(lost)
        _wait_for(lambda: _at(tmp_path, 1, 2)() or not running(), 120, "training on 2")
        shrunk_at = progress(tmp_path)[0]
        _wait_for(lambda: _at(tmp_path, shrunk_at + 3, 2)() or not running(), 120, "steps")
        (tmp_path / "finish").touch()
        assert process.wait(timeout=120) == 0, (tmp_path / "err").read_text()[-3000:]
    finally:
        process.kill()
        cluster.add_node(num_cpus=2)  # three worker nodes again, for what comes next
    out = (tmp_path / "out").read_text()
    started_on = set(re.findall(r"<stdout>:started as rank \d+ on (\w+)", out))
    assert started_on == set(named)  # never the node the script did not name
    ends = re.findall(r"<stdout>:rank \d+ of (\d+): \d+ steps, in step (\w+), sizes (.*)", out)
    assert ends == [("2", "True", "[2, 3]")] * 2, out[-3000:]
    _wait_for(lambda: _our_actors() == [], 30, "every worker actor gone")
