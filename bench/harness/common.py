"""What every benchmark shares: the modes, the rotation, the statistics and the launchers.

Every comparison alternates the systems within each repetition (A, B, C, then B, C, A, ...),
so that drift on a shared machine hits all of them; each figure is reported as the median
and min-max of its runs, and each comparison as the median of the pairwise ratios.

Each benchmark module imports this one before anything that imports ray: it sets Ray's
environment first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

# Ray Train's HorovodTrainer is only in the v1 API; this must precede importing ray.train.
os.environ["RAY_TRAIN_V2_ENABLED"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")

import ray  # noqa: E402

from horovod_ray import local_ray  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
NUM_CPUS = 4


@dataclasses.dataclass(frozen=True)
class Mode:
    """Sizes and repetitions of every benchmark in one ``--mode``."""

    reps: int  # B1, B2 and B3
    b1_bytes: int
    b1_iters: int
    b1_warmup: int
    b2_workers: tuple[int, ...]
    b3_calls: int
    b4_trials: int
    b4_reps: int  # each repetition is two whole Tune runs; see docs/benchmarks.rst
    b5_points: tuple[tuple[int, int], ...]  # (workers, nodes)
    b5_reps: int
    b6_reps: int  # B6 across simulated hosts: each repetition starts a driver there
    b6e_reps: int
    script_reps: int  # B7 and B8: whole scripts, each a few seconds
    b9_reps: int  # each repetition: a restart, a restart by hand and a hang
    scale_sizes: tuple[int, ...]  # --only scale: simulated ranks (see bench/cases/scale.py)
    scale_reps: int
    scale_deadline_s: float  # a rendezvous still going then is recorded as bound
    scale_start_sizes: tuple[int, ...]  # --only scale_start: real ranks on 2 Ray nodes
    resume_reps: int = 1  # B12: each repetition, a restart of horovod_ray's and Ray Train's
    ingest_rows: int = 20_000  # B13: rows of the pipeline, read twice
    ingest_ranks: tuple[int, ...] = (2,)
    ingest_reps: int = 1


MODES = {
    "full": Mode(
        reps=5, b1_bytes=64 << 20, b1_iters=20, b1_warmup=3, b2_workers=(2, 4), b3_calls=300,
        b4_trials=4, b4_reps=1, b5_points=((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)), b5_reps=1,
        b6_reps=2, b6e_reps=2, script_reps=2, b9_reps=2,
        scale_sizes=(64, 256, 1024, 4096), scale_reps=3, scale_deadline_s=60,
        scale_start_sizes=(8, 16, 32), resume_reps=3,
        ingest_rows=200_000, ingest_ranks=(2, 4), ingest_reps=3,
    ),
    # One repetition of each comparison: a pair per ratio, no spreads (see "How to run").
    "quick": Mode(
        reps=1, b1_bytes=64 << 20, b1_iters=10, b1_warmup=2, b2_workers=(2,), b3_calls=100,
        b4_trials=2, b4_reps=1, b5_points=(), b5_reps=1,
        b6_reps=1, b6e_reps=1, script_reps=1, b9_reps=1,
        scale_sizes=(64, 256, 1024, 4096), scale_reps=1, scale_deadline_s=60,
        scale_start_sizes=(8, 16, 32), ingest_rows=200_000, ingest_ranks=(2, 4),
    ),
    "smoke": Mode(
        reps=1, b1_bytes=1 << 20, b1_iters=3, b1_warmup=1, b2_workers=(2,), b3_calls=20,
        b4_trials=2, b4_reps=1, b5_points=((1, 1), (2, 2)), b5_reps=1,
        b6_reps=1, b6e_reps=1, script_reps=1, b9_reps=1,
        scale_sizes=(16, 64), scale_reps=1, scale_deadline_s=20, scale_start_sizes=(4,),
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- statistics


def summary(values: list[float]) -> dict:
    """Median, min, max and every run of one figure."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-repetition ratios (the pairs ran back to back)."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def cold_start_s(start_wall: float, finished_at: list[float]) -> float:
    """Seconds from ``start_wall`` until the last rank was done (wall-clock times)."""
    return max(finished_at) - start_wall


def alternate(systems: dict[str, Callable[[], object]], reps: int, settle: bool = False) -> dict:
    """Runs every system once per repetition, rotating who goes first; each system's
    values in a list (a figure, or a dict of figures from a system that measures several
    at once).

    With ``settle``, each run first waits for the previous run's processes to be gone.
    """
    names = list(systems)
    runs: dict[str, list] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            if settle:
                wait_for_quiet()
            value = systems[name]()
            runs[name].append(value)
            shown = f"{value:10.4f}" if isinstance(value, float) else value
            print(f"  rep {rep + 1}/{reps}  {name:<22} {shown}", flush=True)
    return runs


def timed(
    fn: Callable[[], object],
    iters: int,
    warmup: int,
    start: Callable[[], object],
    finish: Callable[[], object] = lambda: None,
) -> float:
    """Seconds of ``iters`` calls of ``fn`` after ``warmup`` untimed ones, on a rank:
    ``start()`` (the ranks meeting, or a device's queue drained) just before the clock
    starts, ``finish()`` (a device's queue drained) before it stops."""
    for _ in range(warmup):
        fn()
    start()
    began = time.perf_counter()
    for _ in range(iters):
        fn()
    finish()
    return time.perf_counter() - began


def in_own_process(module: str, mode_name: str, timeout_s: float = 1800) -> dict:
    """``python -m module MODE OUT`` in a fresh interpreter (Ray Train v2 cannot share
    one with the v1 API that B2 uses); the figures it wrote to OUT."""
    import json
    import signal
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        # In a session of its own: on a timeout its whole group goes, raylets included.
        child = subprocess.Popen(
            [sys.executable, "-m", module, mode_name, out.name], start_new_session=True
        )
        try:
            code = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        if code != 0:
            raise RuntimeError(f"{module} exited with {code}")
        with open(out.name) as handle:
            return json.load(handle)


# ------------------------------------------------------------------------------- machine

# Ray processes that stay (the last one Ray Train starts once and keeps); any other
# ``ray::`` process is a run's worker.
RAY_SERVICES = {
    "ray::IDLE",
    "ray::DashboardAgent",
    "ray::RuntimeEnvAgent",
    "ray::_AutoscalingCoordinatorActor",
}


def wait_for_quiet(timeout_s: float = 15.0) -> None:
    """Waits until the last run's worker processes have exited.

    A process that has loaded TensorFlow spends up to a second of CPU exiting; started
    next to it, the next cold start would pay for the previous system's teardown.
    """
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        leftovers = []
        for process in psutil.process_iter(["cmdline"]):
            title = (process.info["cmdline"] or [""])[0]
            if title.startswith("ray::") and title.split(" ")[0] not in RAY_SERVICES:
                leftovers.append(title)
        if not leftovers:
            return
        time.sleep(0.05)


@contextlib.contextmanager
def simulated_nodes(cpus_per_node: Sequence[int]) -> Iterator[ray.cluster_utils.Cluster]:
    """A ``ray.cluster_utils.Cluster`` with a Ray node per entry, this driver joined to it."""
    from ray.cluster_utils import Cluster

    cluster = Cluster()
    try:
        for cpus in cpus_per_node:
            cluster.add_node(num_cpus=cpus)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        if cluster.head_node is not None:
            local_ray.stop_monitor(cluster.head_node)
        cluster.shutdown()


# ------------------------------------------------------------------------------ systems


def horovodrun(args: list[str], num_workers: int) -> list[str]:
    """``horovodrun`` of ``bench/cases/workloads.py args`` on this machine; each rank's JSON
    line."""
    command = [
        str(Path(sys.executable).parent / "horovodrun"),
        "--gloo",
        "-np",
        str(num_workers),
        "-H",
        f"localhost:{num_workers}",
        "--network-interface",
        "lo",
        sys.executable,
        str(ROOT / "bench" / "cases" / "workloads.py"),
        *args,
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return re.findall(r"^\[\d+\]<stdout>:(\{.*\})$", out.stdout, re.MULTILINE)


def horovod_ray_run(
    num_workers: int,
    fn,
    *args,
    env: dict | None = None,
    niceness: int | None = None,
    metrics: bool = True,
    find_stragglers: bool = False,
):
    """``fn(*args)`` on ``num_workers`` ranks of a fresh horovod_ray job (``env`` set first;
    ``niceness``: the ranks', None for the Ray's workers'; ``metrics`` off: none exported,
    ``find_stragglers``: the straggler's attribution, horovod's response cache off)."""
    from horovod_ray import RayExecutor

    settings = RayExecutor.create_settings(
        timeout_s=120,
        verbose=0,
        niceness=niceness,
        metrics=metrics,
        find_stragglers=find_stragglers,
    )
    with RayExecutor(settings, num_workers=num_workers) as executor:
        if env:
            executor.run(os.environ.update, args=[env])
        return executor.run(fn, args=list(args))


def reference_run(num_workers: int, fn, *args):
    """``fn(*args)`` on ``num_workers`` ranks of a fresh horovod.ray job (horovod 0.28.1)."""
    from horovod.ray import RayExecutor as ReferenceExecutor

    settings = ReferenceExecutor.create_settings(timeout_s=120)
    executor = ReferenceExecutor(settings, num_workers=num_workers, cpus_per_worker=1)
    executor.start()
    try:
        return executor.run(fn, args=list(args))
    finally:
        executor.shutdown()
