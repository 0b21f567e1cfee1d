"""What a cloud does to a job: B10, a node preempted with notice against one lost
without it (``--only drain``); B11, an elastic job on nodes Ray's autoscaler launches for
it (``--only autoscaler``).

B10: an elastic job of three 1-CPU nodes (and a 0-CPU head), one rank each, a step (an
allreduce and a commit) every 50 ms, on one ``ray.cluster_utils.Cluster``. "drained":
Ray drains one node with a 60 s deadline, as a cloud's preemption notice does, and the
job leaves it; "killed": the node is removed without notice (a spot node lost without one,
or a crash). Each: seconds from the event to the first step on 2 ranks, and the
steps the survivors began twice (rolled back to their last commit: the work lost).
"static": a 2-rank static job (a spare node beside) that checkpoints when told of the
drain (``get_preemption_info()``) and is restarted from that checkpoint (``max_restarts``):
seconds from the drain to its restarted job's first step, and the steps done again; Ray
Train v2's answer to the same drain is ``bench.peers.train_drain``'s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cases import workloads
from bench.cases.b6 import _first_step, _in_thread
from bench.harness.common import Mode, alternate, ratio, simulated_nodes, summary

ROOT = Path(__file__).resolve().parents[2]

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

DEADLINE_S = 60
PAUSE_S = 0.05


def drain(mode: Mode) -> dict:
    print("B10 a node drained with notice against one lost without", flush=True)
    repeated: dict[str, list[int]] = {"drained": [], "killed": []}
    with simulated_nodes((0,)) as cluster:
        runs = alternate(
            {
                "drained": lambda: _measure(cluster, True, repeated["drained"]),
                "killed": lambda: _measure(cluster, False, repeated["killed"]),
            },
            mode.b6e_reps,
        )
        static = [_measure_static(cluster) for _ in range(mode.b6e_reps)]
    return {
        "b10_to_two_ranks_s": {name: summary(values) for name, values in runs.items()},
        "b10_ratio_drained_vs_killed": ratio(runs["drained"], runs["killed"]),
        "b10_steps_begun_twice": {name: max(values) for name, values in repeated.items()},
        "b10_static_to_resumed_s": summary([seconds for seconds, _ in static]),
        "b10_static_steps_done_again": summary([again for _, again in static]),
        "b10_static_deadline_s": DEADLINE_S,
    }


def _measure_static(cluster: Cluster) -> tuple[float, int]:
    """B10's static case: a 2-rank static job (``run(num_hosts=2, max_restarts=1)``, a
    spare node beside) whose steps ask for the preemption notice and checkpoint on it
    (``workloads.told_of_drains``); rank 0's node is drained with a ``DEADLINE_S``
    deadline. Seconds from the drain to the restarted job's first step, and the steps it
    did again (done before the drain's restart, and again after it)."""
    import horovod_ray
    from test.autoscaling import drain_node

    while len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    node = None
    with tempfile.TemporaryDirectory() as name, tempfile.TemporaryDirectory() as storage:
        folder = Path(name)
        thread, outcome = _in_thread(
            lambda: horovod_ray.run(
                workloads.told_of_drains, args=(name, PAUSE_S), num_hosts=2, num_slots=1,
                max_restarts=1, storage_path=storage, name="b10",
            )
        )  # fmt: skip
        try:
            done = _wait_done(folder, lambda lines: len(lines) >= 20)
            node = (folder / "node").read_text()
            at = time.time()
            drain_node(cluster.address, node, deadline_s=DEADLINE_S)
            done = _wait_done(folder, lambda lines: any(a == 1 for a, _, _ in lines))
        finally:
            (folder / "finish").touch()
            thread.join(120)
            for left in [n for n in cluster.worker_nodes if n.node_id == node]:
                cluster.remove_node(left)  # drained: it exits once idle; clean up after
        if thread.is_alive() or "error" in outcome:
            raise RuntimeError(f"the static job did not end cleanly: {outcome.get('error')}")
    return static_figures(done, at)


def _wait_done(folder: Path, enough, timeout_s: float = 240) -> list[tuple[int, int, float]]:
    """Rank 0's ``done`` lines, once ``enough(lines)``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            text = (folder / "done").read_text()
        except FileNotFoundError:
            text = ""
        lines = [(int(a), int(s), float(t)) for a, s, t in map(str.split, text.splitlines())]
        if enough(lines):
            return lines
        time.sleep(0.05)
    raise RuntimeError(f"rank 0's steps did not come within {timeout_s}s")


def static_figures(done: list[tuple[int, int, float]], at: float) -> tuple[float, int]:
    """From rank 0's completed steps (attempt, step, time) and the drain's time: seconds to
    the restarted attempt's first step, and the steps it did again (completed before the
    restart, and again in it). Pure."""
    first = next(i for i, (attempt, _, _) in enumerate(done) if attempt == 1)
    before = [step for attempt, step, _ in done[:first] if attempt == 0]
    return done[first][2] - at, max(0, max(before) - (done[first][1] - 1))


def _measure(cluster: Cluster, notice: bool, repeated: list[int]) -> float:
    """Seconds from the drain (or the removal) to the first step on 2 ranks; the most
    steps a survivor began twice go to ``repeated``."""
    from horovod_ray import RayExecutor
    from test.autoscaling import drain_node

    while len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    settings = RayExecutor.create_settings(timeout_s=30, verbose=0)
    executor = RayExecutor(settings, min_workers=2, max_workers=3, elastic_timeout=60)
    executor.start()
    node = None
    try:
        with tempfile.TemporaryDirectory() as name:
            folder = Path(name)
            thread, outcome = _in_thread(
                lambda: executor.run(workloads.elastic_steps, args=(str(folder), PAUSE_S))
            )
            _first_step(folder, 3, 0.0)
            time.sleep(1)
            node = list(cluster.worker_nodes)[-1]
            at = time.time()
            if notice:
                drain_node(cluster.address, node.node_id, deadline_s=DEADLINE_S)
            else:
                cluster.remove_node(node)
            seconds = _first_step(folder, 2, at) - at
            (folder / "finish").touch()
            thread.join(120)
            if "error" in outcome:
                raise outcome["error"]
            repeated.append(max(again for _, again in outcome["value"]))
    finally:
        executor.stop()
        if notice and node is not None:  # the drained node exits once idle; clean up after
            for left in [n for n in cluster.worker_nodes if n.node_id == node.node_id]:
                cluster.remove_node(left)
    return seconds


def autoscaler(mode: Mode) -> dict:
    """B11: Ray's autoscaler (its fake multi-node provider: a head without CPUs, up to three
    2-CPU nodes, each a raylet on this machine) and test/scripts/autoscaled_elastic.py's
    job (min_workers=2, max_workers=6): seconds from its run() call to the world at 6
    ranks, on nodes the autoscaler launched because the job asked; and from the job's end
    to the idle nodes' removal (idle_timeout_minutes=0.1)."""
    from test.autoscaling import AutoscalingCluster

    print("B11 an elastic job on nodes the autoscaler launches for it", flush=True)
    to_max, gone = [], []
    for _ in range(mode.b6e_reps):
        with tempfile.TemporaryDirectory() as name, AutoscalingCluster(Path(name)) as cluster:
            script = ROOT / "test" / "scripts" / "autoscaled_elastic.py"
            result = subprocess.run(
                [sys.executable, str(script), name],
                cwd=ROOT, env={**cluster.env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                text=True, timeout=300, check=True,
            )  # fmt: skip
        outcome = json.loads(result.stdout.strip().splitlines()[-1])
        if outcome["to_max_workers_s"] is None or outcome["idle_nodes_gone_s"] is None:
            raise RuntimeError(f"the job did not reach 6 ranks, or the nodes stayed: {outcome}")
        to_max.append(outcome["to_max_workers_s"])
        gone.append(outcome["idle_nodes_gone_s"])
        print(f"  to 6 ranks {to_max[-1]} s, idle nodes gone {gone[-1]} s", flush=True)
    return {"b11_to_max_workers_s": summary(to_max), "b11_idle_nodes_gone_s": summary(gone)}
