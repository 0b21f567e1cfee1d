"""B6: across hosts. B1's allreduce with one rank on each of two simulated hosts, and
recovery after a lost node (elastic against restarting a static job).

``b6`` needs simulated hosts (``test/hosts``: root and ``ip netns``); without them it
records why it skipped. ``b6_elastic`` (``--only b6e``) runs on simulated Ray nodes of
one ``ray.cluster_utils.Cluster``.
"""

from __future__ import annotations

import functools
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from bench.cases import workloads
from bench.harness.common import Mode, alternate, ratio, simulated_nodes, summary
from bench.peers.raw_gloo import ensure_gloo_binary, raw_gloo_seconds

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

    from horovod_ray import RayExecutor, Settings


def b6(mode: Mode, may_install: bool) -> dict:
    """B1 across two simulated hosts: one rank on each, over a bridge between namespaces."""
    from test.hosts.simhosts import SimHosts, unavailable_reason

    print("B6 allreduce throughput across two simulated hosts, 1 rank each", flush=True)
    reason = unavailable_reason()
    if reason is not None:
        print(f"  skipped: {reason}")
        return {"b6_skipped": reason}
    nbytes, iters, warmup = mode.b1_bytes, mode.b1_iters, mode.b1_warmup
    megabytes = nbytes * iters / 1e6
    with SimHosts(subnet="10.213.11") as sim:
        first, second = sim.add_host("b1"), sim.add_host("b2", iface="ens5")
        sim.start_ray(first, 1, head=True, dashboard=False)
        sim.start_ray(second, 1)
        sim.wait_for_nodes()
        params = {"bytes": nbytes, "iters": iters, "warmup": warmup}
        systems = {
            "horovod_ray": lambda: (
                megabytes / sim.scenario(first, "allreduce_seconds", **params)["seconds"]
            ),
        }
        if ensure_gloo_binary(may_install):
            systems["raw_gloo"] = lambda: (
                megabytes / raw_gloo_seconds(nbytes, iters, warmup, hosts=(first, second))
            )
        runs = alternate(systems, mode.b6_reps)
    out = {
        "b6_allreduce_mbps": {name: summary(values) for name, values in runs.items()},
        "b6_setup": {"bytes": nbytes, "iters": iters, "warmup": warmup, "hosts": 2},
    }
    if "raw_gloo" in runs:
        out["b6_ratio_vs_raw_gloo"] = ratio(runs["horovod_ray"], runs["raw_gloo"])
    return out


# ------------------------------------------------------------------------ elastic recovery


def b6_elastic(mode: Mode) -> dict:
    """Recovery after a lost node: an elastic job against restarting a static one.

    Three 1-CPU nodes (and a 0-CPU head), one rank each, a step every 50 ms. Elastic:
    from the node's removal to the first step on 2 ranks, then from a new node's arrival
    to the first step on 3. Restart (what a static job's user does): the job fails, is
    stopped, a 2-rank job starts and resumes from rank 0's checkpoint; from the removal to
    its first step.
    """
    from horovod_ray import RayExecutor

    print("B6 elastic recovery after a node loss, 3 -> 2 ranks", flush=True)
    settings = RayExecutor.create_settings(timeout_s=30, verbose=0)
    grow: list[float] = []
    # One cluster for every measurement (a 0-CPU head and the 1-CPU nodes): each starts
    # with three live nodes, and every executor of the last one stopped.
    with simulated_nodes((0,)) as cluster:
        elastic = functools.partial(_elastic, settings, grow)
        restart = functools.partial(_restart, settings)
        runs = alternate(
            {
                "elastic": lambda: _on_cluster(cluster, elastic),
                "restart": lambda: _on_cluster(cluster, restart),
            },
            mode.b6e_reps,
        )
    return {
        "b6_recovery_s": {name: summary(values) for name, values in runs.items()},
        "b6_ratio_vs_restart": ratio(runs["elastic"], runs["restart"]),
        "b6_grow_s": summary(grow),
    }


def _on_cluster(cluster: Cluster, measure: Callable[[Cluster, Path], float]) -> float:
    """``measure`` on three live 1-CPU nodes, with a fresh folder for its ranks' progress."""
    # Back to three 1-CPU nodes: each measurement removes one (and elastic adds one).
    while len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    with tempfile.TemporaryDirectory() as folder:
        return measure(cluster, Path(folder))


def _elastic(settings: Settings, grow: list[float], cluster: Cluster, folder: Path) -> float:
    """Seconds from a node's removal to the first step on 2 ranks of an elastic job; the
    seconds from a new node's arrival to the first step on 3 go to ``grow``."""
    from horovod_ray import RayExecutor

    executor = RayExecutor(settings, min_workers=2, max_workers=3, elastic_timeout=60)
    executor.start()
    try:
        thread, outcome, lost_at = _steps_then_lose_a_node(
            executor, workloads.elastic_steps, cluster, folder
        )
        recovered = _first_step(folder, 2, lost_at) - lost_at
        added_at = time.time()
        cluster.add_node(num_cpus=1)
        grow.append(_first_step(folder, 3, added_at) - added_at)
        (folder / "finish").touch()
        thread.join(120)
        if "error" in outcome:
            raise outcome["error"]
        return recovered
    finally:
        executor.stop()


def _restart(settings: Settings, cluster: Cluster, folder: Path) -> float:
    """Seconds from a node's removal under a static 3-rank job to the first step of the
    2-rank job started after it failed, resuming from rank 0's checkpoint."""
    from horovod_ray import RayExecutor

    first = RayExecutor(settings, num_hosts=3, num_workers_per_host=1)
    first.start()
    try:
        thread, outcome, lost_at = _steps_then_lose_a_node(
            first, workloads.checkpointed_steps, cluster, folder
        )
        thread.join(120)
    finally:
        first.stop()
    if "error" not in outcome:
        raise RuntimeError("the static job did not fail when its node went")
    second = RayExecutor(settings, num_hosts=2, num_workers_per_host=1)
    second.start()
    try:
        thread, outcome = _in_thread(
            lambda: second.run(workloads.checkpointed_steps, args=(str(folder), 0.05))
        )
        recovered = _first_step(folder, 2, lost_at) - lost_at
        (folder / "finish").touch()
        thread.join(120)
        return recovered
    finally:
        second.stop()


def _steps_then_lose_a_node(
    executor: RayExecutor, steps: Callable, cluster: Cluster, folder: Path
) -> tuple[threading.Thread, dict, float]:
    """Runs ``steps`` on 3 ranks in a thread; once they step, removes a node."""
    thread, outcome = _in_thread(lambda: executor.run(steps, args=(str(folder), 0.05)))
    _first_step(folder, 3, 0.0)
    time.sleep(1)
    lost_at = time.time()
    cluster.remove_node(list(cluster.worker_nodes)[-1])
    return thread, outcome, lost_at


def _progress(folder: Path) -> tuple[int, int, float]:
    """Rank 0's last step, ranks then and wall time, as it last wrote them (zeros before)."""
    try:
        step, size, at = (folder / "progress").read_text().split()
        return int(step), int(size), float(at)
    except (FileNotFoundError, ValueError):
        return 0, 0, 0.0


def _first_step(folder: Path, size: int, after: float, timeout_s: float = 240) -> float:
    """Wall time of rank 0's first step on ``size`` ranks done after ``after``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, now, at = _progress(folder)
        if now == size and at > after:
            return at
        time.sleep(0.02)
    raise RuntimeError(f"no step on {size} ranks within {timeout_s}s")


def _in_thread(call: Callable[[], object]) -> tuple[threading.Thread, dict]:
    """Starts ``call`` in a thread; its ``"value"`` or ``"error"`` lands in the dict."""
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except Exception as err:  # noqa: BLE001 - read by the caller
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome
