"""Elastic jobs on nodes that Ray's own autoscaler launches for them (its fake multi-node
provider: the same autoscaler, each node an extra raylet on this machine)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from test.autoscaling import AutoscalingCluster
from test.conftest import ROOT

pytestmark = pytest.mark.timeout(400)


def test_an_elastic_job_grows_onto_the_nodes_the_autoscaler_launches_for_it(tmp_path):
    """A head without CPUs, up to three 2-CPU nodes: the job's request for 6 ranks makes
    the autoscaler launch them, and the job (min_workers=2), which starts as soon as the
    first is up, ends on 6 ranks, though the others come while its first ranks start
    (without patches/horovod-0.28.1-elastic-early-host-update.patch it ran to its end on
    2). When run() ends its request is withdrawn and the autoscaler removes the idle
    nodes."""
    with AutoscalingCluster(tmp_path, max_nodes=3, cpus_per_node=2) as cluster:
        result = subprocess.run(
            [sys.executable, str(ROOT / "test" / "scripts" / "autoscaled_elastic.py"),
             str(tmp_path)],
            cwd=ROOT, env={**cluster.env, "PYTHONPATH": str(ROOT)}, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    sizes = outcome["sizes"]
    assert sizes[-3:] == [6, 6, 6], outcome
    assert outcome["to_max_workers_s"] is not None  # the membership event said so too
    assert outcome["request"] == []
    assert outcome["idle_nodes_gone_s"] is not None
    assert not cluster.pids()


def _drive_a_job_kept_on_the_drivers_machine(folder: str) -> None:
    """A driver of the fake cluster (RAY_ADDRESS): has one node launched and clears its
    own request, then runs an elastic job (min_workers=2, max_workers=6, 1-CPU ranks) that
    the node's 2 CPUs hold; the node has the driver's address, so the job stays on this
    machine. Prints one JSON line: rank 0's world size at each step, Ray's standing request
    read every second while the job ran, and the worker nodes alive at its end."""
    import threading
    import time
    from pathlib import Path

    import ray
    from ray.autoscaler.sdk import request_resources

    import horovod_ray
    from test.autoscaling import alive_worker_nodes, standing_request
    from test.elastic_training import grow_after_a_slow_start

    ray.init(logging_level="ERROR", log_to_driver=False)
    request_resources(bundles=[{"CPU": 2}])
    deadline = time.monotonic() + 120
    while alive_worker_nodes() < 1:
        assert time.monotonic() < deadline, "the autoscaler launched no node"
        time.sleep(0.5)
    request_resources(bundles=[])
    Path(folder, "go").touch()
    requests: list[list[dict]] = []
    ended = threading.Event()

    def watch() -> None:
        while not ended.wait(1.0):
            requests.append(standing_request())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        results = horovod_ray.run(
            grow_after_a_slow_start,
            args=(folder, 6, 40),
            min_workers=2,
            max_workers=6,
            cpus_per_slot=1,
            elastic_timeout=120,
        )
    finally:
        ended.set()
        watcher.join()
    outcome = {"sizes": results[0], "requests": requests, "nodes": alive_worker_nodes()}
    print(json.dumps(outcome))


def test_an_elastic_job_kept_on_the_drivers_machine_asks_the_autoscaler_for_nothing(tmp_path):
    """Every node with room when the job starts has the driver's address, so the job
    stays on that machine (loopback, only nodes with that address): the nodes an
    autoscaler launches on a cloud are other machines, which it would never use. It sends
    no request, so none is launched for it (before, it asked for 6 ranks' room for its
    whole run, and here, where the fake nodes share the address, it grew onto them)."""
    with AutoscalingCluster(tmp_path, max_nodes=3, cpus_per_node=2, idle_minutes=1) as cluster:
        code = (
            "from test.job.test_autoscaler import _drive_a_job_kept_on_the_drivers_machine\n"
            f"_drive_a_job_kept_on_the_drivers_machine({str(tmp_path)!r})\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env={**cluster.env, "PYTHONPATH": str(ROOT)},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["requests"] and all(r == [] for r in outcome["requests"]), outcome
    assert set(outcome["sizes"]) == {2} and len(outcome["sizes"]) == 40, outcome
    assert outcome["nodes"] == 1
    assert not cluster.pids()
