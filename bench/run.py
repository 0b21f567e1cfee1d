"""Side-by-side benchmarks: horovod_ray against what a user would otherwise pick.

    python -m bench.run --mode full    # make bench: >= 5 alternating repetitions
    python -m bench.run --mode quick   # make bench-quick: fewer repetitions
    python -m bench.run --mode smoke   # CI: smallest sizes, one repetition

Every comparison runs in this one invocation, alternating the systems within each
repetition (A, B, C, then B, C, A, ...), so that drift on a shared machine hits all of them.
Reports the median and min-max of each figure and the median of the pairwise ratios;
writes bench/results/latest.json and PNG plots there. What each figure means:
docs/benchmarks.rst.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

# Ray Train's HorovodTrainer is only in the v1 API; this must precede importing ray.train.
os.environ["RAY_TRAIN_V2_ENABLED"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("PYTHONWARNINGS", "ignore::DeprecationWarning")

import ray  # noqa: E402

from bench import scale, workloads  # noqa: E402
from horovod_ray import local_ray  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
GLOO_BINARY = ROOT / "build" / "gloo_allreduce"
NUM_CPUS = 4


@dataclasses.dataclass(frozen=True)
class Mode:
    reps: int
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
    scale_sizes: tuple[int, ...]  # --only scale: simulated ranks (see bench/scale.py)
    scale_reps: int
    scale_deadline_s: float  # a rendezvous still going then is recorded as bound
    scale_start_sizes: tuple[int, ...]  # --only scale_start: real ranks on 2 Ray nodes


MODES = {
    "full": Mode(
        reps=5, b1_bytes=64 << 20, b1_iters=40, b1_warmup=3, b2_workers=(2, 4), b3_calls=300,
        b4_trials=8, b4_reps=2, b5_points=((1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4)),
        b5_reps=1, b6_reps=3, b6e_reps=3, script_reps=3,
        scale_sizes=(64, 256, 1024, 4096), scale_reps=3, scale_deadline_s=60,
        scale_start_sizes=(8, 16, 32),
    ),
    "quick": Mode(
        reps=2, b1_bytes=64 << 20, b1_iters=10, b1_warmup=2, b2_workers=(2,), b3_calls=100,
        b4_trials=4, b4_reps=1, b5_points=(), b5_reps=1, b6_reps=2, b6e_reps=1,
        script_reps=2, scale_sizes=(64, 256, 1024, 4096), scale_reps=1, scale_deadline_s=60,
        scale_start_sizes=(8, 16, 32),
    ),
    "smoke": Mode(
        reps=1, b1_bytes=1 << 20, b1_iters=3, b1_warmup=1, b2_workers=(2,), b3_calls=20,
        b4_trials=2, b4_reps=1, b5_points=((1, 1), (2, 2)), b5_reps=1, b6_reps=1, b6e_reps=1,
        script_reps=1, scale_sizes=(16, 64), scale_reps=1, scale_deadline_s=20,
        scale_start_sizes=(4,),
    ),
}  # fmt: skip


# --------------------------------------------------------------------------- statistics


def summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-repetition ratios (the pairs ran back to back)."""
    return statistics.median(a / b for a, b in zip(numerators, denominators, strict=True))


def alternate(
    systems: dict[str, Callable[[], float]], reps: int, settle: bool = False
) -> dict[str, list[float]]:
    """Runs every system once per repetition, rotating who goes first.

    With ``settle``, each run first waits for the previous run's processes to be gone.
    """
    names = list(systems)
    runs: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            if settle:
                wait_for_quiet()
            value = systems[name]()
            runs[name].append(value)
            print(f"  rep {rep + 1}/{reps}  {name:<22} {value:10.4f}", flush=True)
    return runs


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


def _horovodrun(args: list[str], num_workers: int) -> list[str]:
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
        str(ROOT / "bench" / "workloads.py"),
        *args,
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True)
    return re.findall(r"^\[\d+\]<stdout>:(\{.*\})$", out.stdout, re.MULTILINE)


def ensure_gloo_binary(may_install: bool) -> bool:
    """Builds the raw Gloo benchmark (installing libgloo-dev when missing and allowed)."""
    if GLOO_BINARY.exists():
        return True
    headers = Path("/usr/include/gloo/allreduce_ring.h").exists()
    if not headers and not (may_install and shutil.which("apt-get")):
        print("  raw Gloo skipped: libgloo-dev is not installed (make bench installs it)")
        return False
    if not headers:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libgloo-dev"], env=env, check=False)
    build = ROOT / "build"
    for step in (
        ["cmake", "-S", str(ROOT), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release"],
        ["cmake", "--build", str(build), "-j2"],
    ):
        if subprocess.run(step, capture_output=True, text=True).returncode != 0:
            print(f"  could not build the raw Gloo benchmark: {' '.join(step)}", flush=True)
            return False
    return GLOO_BINARY.exists()


def raw_gloo_seconds(nbytes: int, iters: int, warmup: int, hosts: tuple = ()) -> float:
    """Seconds of the C++ ring on 2 ranks: on loopback, or one on each of two ``hosts``."""
    with tempfile.TemporaryDirectory() as store:
        procs = [
            subprocess.Popen(
                _on_host(hosts, rank)
                + [
                    str(GLOO_BINARY),
                    "--rank",
                    str(rank),
                    "--size",
                    "2",
                    "--store",
                    store,
                    "--bytes",
                    str(nbytes),
                    "--iters",
                    str(iters),
                    "--warmup",
                    str(warmup),
                    "--host",
                    hosts[rank].address if hosts else "127.0.0.1",
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in (1, 0)
        ]
        outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    return json.loads(outputs[1])["seconds"]


def _on_host(hosts: tuple, rank: int) -> list[str]:
    """The prefix that runs a command on rank's simulated host (none on this machine)."""
    if not hosts:
        return []
    return hosts[rank].command([])


def horovod_ray_run(num_workers: int, fn, *args, env: dict | None = None):
    from horovod_ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=120, verbose=0)
    with RayExecutor(settings, num_workers=num_workers) as executor:
        if env:
            executor.run(os.environ.update, args=[env])
        return executor.run(fn, args=list(args))


def reference_run(num_workers: int, fn, *args):
    from horovod.ray import RayExecutor as ReferenceExecutor

    settings = ReferenceExecutor.create_settings(timeout_s=120)
    executor = ReferenceExecutor(settings, num_workers=num_workers, cpus_per_worker=1)
    executor.start()
    try:
        return executor.run(fn, args=list(args))
    finally:
        executor.shutdown()


def horovod_trainer_first_allreduce(num_workers: int) -> None:
    from ray.train import ScalingConfig
    from ray.train.horovod import HorovodTrainer

    def loop():
        from ray import train

        train.report({"at": workloads.first_allreduce()})

    trainer = HorovodTrainer(
        loop,
        scaling_config=ScalingConfig(num_workers=num_workers, trainer_resources={"CPU": 0}),
    )
    result = trainer.fit()
    return result.metrics["at"]


# --------------------------------------------------------------------------- benchmarks


def b1(mode: Mode, may_install: bool) -> dict:
    print("B1 allreduce throughput, 2 workers", flush=True)
    nbytes, iters, warmup = mode.b1_bytes, mode.b1_iters, mode.b1_warmup
    megabytes = nbytes * iters / 1e6

    def mbps(seconds: float) -> float:
        return megabytes / seconds

    systems = {
        "horovod_ray": lambda: mbps(
            horovod_ray_run(2, workloads.allreduce_throughput, nbytes, iters, warmup)[0]
        ),
        "horovodrun": lambda: mbps(
            json.loads(_horovodrun(["b1", str(nbytes), str(iters), str(warmup)], 2)[0])["seconds"]
        ),
        "horovod.ray": lambda: mbps(
            reference_run(2, workloads.allreduce_throughput, nbytes, iters, warmup)[0]
        ),
    }
    if ensure_gloo_binary(may_install):
        systems["raw_gloo"] = lambda: mbps(raw_gloo_seconds(nbytes, iters, warmup))
    runs = alternate(systems, mode.reps)
    out = {
        "b1_allreduce_mbps": {name: summary(values) for name, values in runs.items()},
        "b1_ratio_vs_horovodrun": ratio(runs["horovod_ray"], runs["horovodrun"]),
        "b1_ratio_vs_horovod_ray": ratio(runs["horovod_ray"], runs["horovod.ray"]),
        "b1_setup": {"bytes": nbytes, "iters": iters, "warmup": warmup, "workers": 2},
    }
    if "raw_gloo" in runs:
        out["b1_ratio_vs_raw_gloo"] = ratio(runs["horovod_ray"], runs["raw_gloo"])
    return out


# Horovod settings tried one at a time against the defaults (sweep, not in the default set).
SWEEP_SETTINGS = {
    "defaults": {},
    "no fusion": {"HOROVOD_FUSION_THRESHOLD": "0"},
    "cycle 0.1 ms": {"HOROVOD_CYCLE_TIME": "0.1"},
    "cycle 5 ms": {"HOROVOD_CYCLE_TIME": "5"},
    "no cache": {"HOROVOD_CACHE_CAPACITY": "0"},
}
SWEEP_POINTS = ((1 << 20, 2), (8 << 20, 2), (64 << 20, 2), (256 << 20, 2), (64 << 20, 4))


def sweep(mode: Mode, may_install: bool, points: Sequence[tuple[int, int]]) -> dict:
    """B1's allreduce under each of SWEEP_SETTINGS, at several sizes and rank counts, with
    the C++ ring beside them (2 ranks). Run with ``--only sweep``."""
    out = {}
    for nbytes, workers in points:
        out[f"{nbytes >> 20}MB x{workers}"] = _sweep_point(mode, may_install, nbytes, workers)
    return {"sweep_mbps": out}


def _sweep_point(mode: Mode, may_install: bool, nbytes: int, workers: int) -> dict:
    iters = max(5, min(60, (2 << 30) // nbytes))
    megabytes = nbytes * iters / 1e6
    print(f"sweep: {nbytes >> 20} MB x {iters} on {workers} ranks", flush=True)

    def ours(env: dict) -> float:
        args = (nbytes, iters, 2)
        return (
            megabytes / horovod_ray_run(workers, workloads.allreduce_throughput, *args, env=env)[0]
        )

    systems: dict[str, Callable[[], float]] = {
        name: functools.partial(ours, env) for name, env in SWEEP_SETTINGS.items()
    }
    if workers == 2 and ensure_gloo_binary(may_install):
        systems["raw_gloo"] = lambda: megabytes / raw_gloo_seconds(nbytes, iters, 2)
    runs = alternate(systems, mode.reps)
    point: dict = {name: summary(values) for name, values in runs.items()}
    point["ratio_vs_defaults"] = {name: ratio(v, runs["defaults"]) for name, v in runs.items()}
    return point


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


def _cold(start_wall: float, finished_at: list[float]) -> float:
    return max(finished_at) - start_wall


_FLOOR_CODE = (
    "import os, time; os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2'); "
    "import tensorflow, horovod.tensorflow; print(time.time(), flush=True)"
)


def import_floor(workers: int) -> list[float]:
    """B2's floor: ``workers`` fresh processes, started together, that import TensorFlow
    and horovod (what no launcher can skip); when each was done."""
    processes = [
        subprocess.Popen([sys.executable, "-c", _FLOOR_CODE], stdout=subprocess.PIPE, text=True)
        for _ in range(workers)
    ]
    return [float(process.communicate(timeout=300)[0]) for process in processes]


def b2(mode: Mode) -> dict:
    out: dict = {
        "b2_cold_start_s": {},
        "b2_ratio_vs_horovod_ray": {},
        "b2_ratio_vs_horovod_trainer": {},
        "b2_floor_s": {},
        "b2_overhead_above_floor_s": {},
    }
    for workers in mode.b2_workers:
        print(f"B2 cold start to first allreduce, {workers} workers", flush=True)

        def measure(run: Callable[[], list[float]]) -> float:
            start = time.time()
            return _cold(start, run())

        systems = {
            "horovod_ray": lambda w=workers: measure(
                lambda: horovod_ray_run(w, workloads.first_allreduce)
            ),
            "horovod.ray": lambda w=workers: measure(
                lambda: reference_run(w, workloads.first_allreduce)
            ),
            "HorovodTrainer": lambda w=workers: measure(
                lambda: [horovod_trainer_first_allreduce(w)]
            ),
            "horovodrun": lambda w=workers: measure(
                lambda: [json.loads(line)["first_allreduce_at"] for line in _horovodrun(["b2"], w)]
            ),
            "import floor": lambda w=workers: measure(lambda: import_floor(w)),
        }
        runs = alternate(systems, mode.reps, settle=True)
        floor = runs.pop("import floor")
        key = str(workers)
        out["b2_floor_s"][key] = summary(floor)
        out["b2_overhead_above_floor_s"][key] = {
            name: statistics.median(a - b for a, b in zip(values, floor, strict=True))
            for name, values in runs.items()
        }
        out["b2_cold_start_s"][key] = {name: summary(values) for name, values in runs.items()}
        out["b2_ratio_vs_horovod_ray"][key] = ratio(runs["horovod_ray"], runs["horovod.ray"])
        out["b2_ratio_vs_horovod_trainer"][key] = ratio(runs["horovod_ray"], runs["HorovodTrainer"])
    return out


def b3(mode: Mode) -> dict:
    print("B3 call overhead, 4 workers, no-op", flush=True)
    from horovod_ray import RayExecutor

    # No CPU reserved: the executor's 4 workers hold the 4 CPUs while both run.
    @ray.remote(num_cpus=0)
    class Bare:
        def noop(self):
            return None

    def timed(call: Callable[[], object]) -> float:
        samples = []
        for _ in range(mode.b3_calls):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e3

    bare = [Bare.remote() for _ in range(4)]
    ray.get([actor.noop.remote() for actor in bare])
    with RayExecutor(RayExecutor.create_settings(verbose=0), num_workers=4) as executor:
        executor.execute(workloads.noop)
        systems = {
            "horovod_ray": lambda: timed(lambda: executor.execute(workloads.noop)),
            "horovod_ray run()": lambda: timed(lambda: executor.run(os.getpid)),
            "bare_ray": lambda: timed(lambda: ray.get([a.noop.remote() for a in bare])),
        }
        runs = alternate(systems, mode.reps)
    for actor in bare:
        ray.kill(actor)
    return {
        "b3_call_ms": {name: summary(values) for name, values in runs.items()},
        "b3_ratio": ratio(runs["horovod_ray"], runs["bare_ray"]),
        "b3_run_ratio": ratio(runs["horovod_ray run()"], runs["bare_ray"]),
    }


def b4(mode: Mode, storage: str) -> dict:
    print(f"B4 Tune turnaround, {mode.b4_trials} trials x 2 workers on {NUM_CPUS} CPUs")
    from ray import tune
    from ray.train import RunConfig, ScalingConfig
    from ray.train.horovod import HorovodTrainer

    from horovod_ray.tune import DistributedTrainableCreator

    # The same Tune settings for both; Tune hands a finished trial's actor to the next.
    tune_config = tune.TuneConfig(num_samples=mode.b4_trials, reuse_actors=True)

    def ours() -> float:
        start = time.perf_counter()
        results = tune.Tuner(
            DistributedTrainableCreator(workloads.one_report_trial, num_hosts=1, num_slots=2),
            tune_config=tune_config,
            run_config=tune.RunConfig(storage_path=storage, verbose=0),
        ).fit()
        assert results.num_errors == 0, results.errors
        return time.perf_counter() - start

    def trainer() -> float:
        def loop(config):
            from ray import train

            train.report({"at": workloads.first_allreduce()})

        start = time.perf_counter()
        results = tune.Tuner(
            HorovodTrainer(
                loop,
                scaling_config=ScalingConfig(num_workers=2, trainer_resources={"CPU": 0}),
                run_config=RunConfig(storage_path=storage),
            ),
            tune_config=tune_config,
            run_config=tune.RunConfig(storage_path=storage, verbose=0),
        ).fit()
        assert results.num_errors == 0, results.errors
        return time.perf_counter() - start

    runs = alternate({"horovod_ray": ours, "HorovodTrainer": trainer}, mode.b4_reps)
    return {
        "b4_tune_s": {name: summary(values) for name, values in runs.items()},
        "b4_ratio": ratio(runs["horovod_ray"], runs["HorovodTrainer"]),
    }


def scripts(mode: Mode, with_b7: bool, with_b8: bool) -> dict:
    """B7 and B8: whole scripts from a fresh process, against ``horovodrun`` of the same work.

    B7: ``workloads.py b2`` under ``horovod-ray run -np 2``, starting its own local Ray or
    joining one that already runs (started here, as a user's cluster would be). B8:
    ``b8_script.py``, a script that calls ``horovod_ray.run`` and so starts the local Ray
    itself, split into its ``ray.init`` (timed inside the script) and the rest. The runs
    that start their own Ray share one rotation and one set of ``horovodrun`` runs.
    """
    print("B7/B8 scripts: one allreduce on 2 ranks from a fresh process", flush=True)
    script = [sys.executable, str(ROOT / "bench" / "workloads.py"), "b2"]
    cli = [sys.executable, "-m", "horovod_ray", "run", "-np", "2"]

    def timed(command: list[str], prints: str) -> tuple[float, str]:
        wait_for_quiet()
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - start
        if out.returncode != 0 or not re.search(prints, out.stdout):
            raise RuntimeError(f"{command[:6]} failed: {out.stderr[-2000:]}")
        return seconds, out.stdout

    ray_start_s: list[float] = []

    def b8_script() -> float:
        command = [sys.executable, str(ROOT / "bench" / "b8_script.py"), "2"]
        seconds, stdout = timed(command, r"ranks 2 ray_start_s ")
        # Searched for: Ray may relay a worker's line after the script's own last one.
        ray_start_s.append(float(re.search(r"ray_start_s (\S+)", stdout)[1]))
        return seconds

    both_ranks = r"(?s)<stdout>:\{.*<stdout>:\{"  # each rank printed its figures
    horovodrun = [
        str(Path(sys.executable).parent / "horovodrun"), "--gloo", "-np", "2",
        "-H", "localhost:2", *script,
    ]  # fmt: skip
    systems = {"horovodrun": lambda: timed(horovodrun, both_ranks)[0]}
    if with_b7:
        systems["horovod-ray local"] = lambda: timed(cli + script, both_ranks)[0]
    if with_b8:
        systems["horovod_ray"] = b8_script
    local = alternate(systems, mode.script_reps)
    out: dict = {}
    if with_b8:
        out.update(
            b8_script_s={name: summary(local[name]) for name in ("horovod_ray", "horovodrun")},
            b8_ratio_vs_horovodrun=ratio(local["horovod_ray"], local["horovodrun"]),
            b8_ray_start_s=summary(ray_start_s),
            b8_after_ray_start_s=statistics.median(
                a - b for a, b in zip(local["horovod_ray"], ray_start_s, strict=True)
            ),
        )
    if with_b7:
        local_ray.start(num_cpus=NUM_CPUS, log_to_driver=False)
        try:
            address = ray.get_runtime_context().gcs_address
            joining = alternate(
                {
                    "horovodrun": lambda: timed(horovodrun, both_ranks)[0],
                    "horovod-ray joining": lambda: timed(
                        [*cli, "--address", address, *script], both_ranks
                    )[0],
                },
                mode.script_reps,
            )
        finally:
            local_ray.stop()
        runs = {
            "horovodrun": local["horovodrun"] + joining["horovodrun"],
            "horovod-ray local": local["horovod-ray local"],
            "horovod-ray joining": joining["horovod-ray joining"],
        }
        out.update(
            b7_script_s={name: summary(values) for name, values in runs.items()},
            b7_ratio_vs_horovodrun=ratio(joining["horovod-ray joining"], joining["horovodrun"]),
            b7_ratio_local_vs_horovodrun=ratio(local["horovod-ray local"], local["horovodrun"]),
        )
    return out


def _progress(folder: Path) -> tuple[int, int, float]:
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
    outcome: dict = {}

    def target() -> None:
        try:
            outcome["value"] = call()
        except Exception as err:  # noqa: BLE001 - read by the caller
            outcome["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def b6_elastic(mode: Mode) -> dict:
    """Recovery after a lost node: an elastic job against restarting a static one.

    Three 1-CPU nodes (and a 0-CPU head), one rank each, a step every 50 ms. Elastic:
    from the node's removal to the first step on 2 ranks, then from a new node's arrival
    to the first step on 3. Restart (what a static job's user does): the job fails, is
    stopped, a 2-rank job starts and resumes from rank 0's checkpoint; from the removal to
    its first step.
    """
    from ray.cluster_utils import Cluster

    from horovod_ray import RayExecutor

    print("B6 elastic recovery after a node loss, 3 -> 2 ranks", flush=True)
    settings = RayExecutor.create_settings(timeout_s=30, verbose=0)

    def on_cluster(measure: Callable[[Cluster, Path], float]) -> float:
        # Back to three 1-CPU nodes: each measurement removes one (and elastic adds one).
        while len(cluster.worker_nodes) < 3:
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        with tempfile.TemporaryDirectory() as folder:
            return measure(cluster, Path(folder))

    grow: list[float] = []

    def steps_then_lose_a_node(
        executor: RayExecutor, steps: Callable, cluster: Cluster, folder: Path
    ) -> tuple[threading.Thread, dict, float]:
        """Runs ``steps`` on 3 ranks in a thread; once they step, removes a node."""
        thread, outcome = _in_thread(lambda: executor.run(steps, args=(str(folder), 0.05)))
        _first_step(folder, 3, 0.0)
        time.sleep(1)
        lost_at = time.time()
        cluster.remove_node(list(cluster.worker_nodes)[-1])
        return thread, outcome, lost_at

    def elastic(cluster: Cluster, folder: Path) -> float:
        executor = RayExecutor(settings, min_workers=2, max_workers=3, elastic_timeout=60)
        executor.start()
        try:
            thread, outcome, lost_at = steps_then_lose_a_node(
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

    def restart(cluster: Cluster, folder: Path) -> float:
        first = RayExecutor(settings, num_hosts=3, num_workers_per_host=1)
        first.start()
        try:
            thread, outcome, lost_at = steps_then_lose_a_node(
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

    # One cluster for every measurement (a 0-CPU head and the 1-CPU nodes): each starts
    # with three live nodes, and every executor of the last one stopped.
    with simulated_nodes((0,)) as cluster:
        runs = alternate(
            {
                "elastic": lambda: on_cluster(elastic),
                "restart": lambda: on_cluster(restart),
            },
            mode.b6e_reps,
        )
    return {
        "b6_recovery_s": {name: summary(values) for name, values in runs.items()},
        "b6_ratio_vs_restart": ratio(runs["elastic"], runs["restart"]),
        "b6_grow_s": summary(grow),
    }


def b5(mode: Mode) -> dict:
    from horovod_ray import RayExecutor

    if not mode.b5_points:
        print("B5 scaling: not in this mode", flush=True)
        return {}
    print("B5 scaling: cold start + first allreduce over simulated nodes", flush=True)
    out: dict = {}
    for workers, nodes in mode.b5_points:
        with simulated_nodes([workers // nodes] * nodes):
            values = []
            for _ in range(mode.b5_reps):
                start = time.time()
                settings = RayExecutor.create_settings(timeout_s=120, verbose=0)
                with RayExecutor(
                    settings, num_hosts=nodes, num_workers_per_host=workers // nodes
                ) as executor:
                    values.append(_cold(start, executor.run(workloads.first_allreduce)))
            out[f"{workers}x{nodes}"] = {"workers": workers, "nodes": nodes, **summary(values)}
            print(f"  {workers} workers on {nodes} nodes: {statistics.median(values):.2f}s")
    return {"b5_cold_start_s": out}


# ------------------------------------------------------------------------------ report


def print_table(results: dict) -> None:
    def row(name: str, s: dict, unit: str) -> str:
        return f"  {name:<18} {s['median']:10.3f} {unit:<5} ({s['min']:.3f} - {s['max']:.3f})"

    print("\n== results (median, min - max) ==")
    if "b1_allreduce_mbps" in results:
        print("B1 allreduce throughput")
        for name, s in results["b1_allreduce_mbps"].items():
            print(row(name, s, "MB/s"))
        for key in ("b1_ratio_vs_horovodrun", "b1_ratio_vs_raw_gloo", "b1_ratio_vs_horovod_ray"):
            if key in results:
                print(f"  {key:<32} {results[key]:.3f}")
    for workers, systems in results.get("b2_cold_start_s", {}).items():
        print(f"B2 cold start, {workers} workers")
        for name, s in systems.items():
            print(row(name, s, "s"))
        print(
            f"  ratio vs horovod.ray {results['b2_ratio_vs_horovod_ray'][workers]:.3f}"
            f"  vs HorovodTrainer {results['b2_ratio_vs_horovod_trainer'][workers]:.3f}"
        )
        if workers in results.get("b2_floor_s", {}):
            above = results["b2_overhead_above_floor_s"][workers]
            print(
                f"  import floor {results['b2_floor_s'][workers]['median']:.3f} s; above it: "
                + ", ".join(f"{name} {value:+.3f} s" for name, value in above.items())
            )
    if "b3_call_ms" in results:
        print("B3 no-op call, 4 workers")
        for name, s in results["b3_call_ms"].items():
            print(row(name, s, "ms"))
        print(f"  b3_ratio {results['b3_ratio']:.3f}  b3_run_ratio {results['b3_run_ratio']:.3f}")
    if "b4_tune_s" in results:
        print("B4 Tune turnaround")
        for name, s in results["b4_tune_s"].items():
            print(row(name, s, "s"))
        print(f"  b4_ratio {results['b4_ratio']:.3f}")
    for point, s in results.get("b5_cold_start_s", {}).items():
        print(f"B5 {point:<6} {s['median']:.2f}s")
    if "b6_allreduce_mbps" in results:
        print("B6 allreduce across two simulated hosts")
        for name, s in results["b6_allreduce_mbps"].items():
            print(row(name, s, "MB/s"))
        if "b6_ratio_vs_raw_gloo" in results:
            print(f"  b6_ratio_vs_raw_gloo {results['b6_ratio_vs_raw_gloo']:.3f}")
    for point, systems in results.get("sweep_mbps", {}).items():
        ratios = systems["ratio_vs_defaults"]
        print(f"sweep {point}: " + ", ".join(f"{n} {r:.3f}" for n, r in ratios.items()))
    if "b6_recovery_s" in results:
        print("B6 elastic recovery after a node loss (s)")
        for name, s in results["b6_recovery_s"].items():
            print(row(name, s, "s"))
        print(row("grow back", results["b6_grow_s"], "s"))
        print(f"  b6_ratio_vs_restart {results['b6_ratio_vs_restart']:.3f}")
    if "b8_script_s" in results:
        print("B8 fresh script to result, 2 ranks")
        for name, s in results["b8_script_s"].items():
            print(row(name, s, "s"))
        print(row("its ray.init", results["b8_ray_start_s"], "s"))
        print(
            f"  b8_ratio_vs_horovodrun {results['b8_ratio_vs_horovodrun']:.3f}; after Ray's "
            f"start {results['b8_after_ray_start_s']:.3f} s"
        )
    if "b7_script_s" in results:
        print("B7 script wall time, 2 ranks")
        for name, s in results["b7_script_s"].items():
            print(row(name, s, "s"))
        print(
            f"  b7_ratio_vs_horovodrun (joining) {results['b7_ratio_vs_horovodrun']:.3f}"
            f"  local {results['b7_ratio_local_vs_horovodrun']:.3f}"
        )


def plot(results: dict, directory: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def bars(title: str, data: dict, unit: str, name: str) -> None:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = list(data)
        medians = [data[k]["median"] for k in labels]
        errors = [
            [m - data[k]["min"] for k, m in zip(labels, medians, strict=True)],
            [data[k]["max"] - m for k, m in zip(labels, medians, strict=True)],
        ]
        ax.bar(labels, medians, yerr=errors, capsize=4, color="#4c72b0")
        ax.set_title(title)
        ax.set_ylabel(unit)
        fig.tight_layout()
        fig.savefig(directory / name, dpi=100)
        plt.close(fig)
        written.append(name)

    if "b1_allreduce_mbps" in results:
        bars("B1 allreduce, 2 workers", results["b1_allreduce_mbps"], "MB/s", "b1_allreduce.png")
    if "b6_allreduce_mbps" in results:
        title = "B6 allreduce across 2 simulated hosts"
        bars(title, results["b6_allreduce_mbps"], "MB/s", "b6_allreduce_hosts.png")
    for workers, systems in results.get("b2_cold_start_s", {}).items():
        bars(f"B2 cold start, {workers} workers", systems, "seconds", f"b2_cold_{workers}.png")
    if "b4_tune_s" in results:
        bars("B4 Tune turnaround", results["b4_tune_s"], "seconds", "b4_tune.png")
    if "b7_script_s" in results:
        bars("B7 script wall time, 2 ranks", results["b7_script_s"], "seconds", "b7_script.png")
    if results.get("b5_cold_start_s"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        by_nodes: dict[int, list[tuple[int, float]]] = {}
        for s in results["b5_cold_start_s"].values():
            by_nodes.setdefault(s["nodes"], []).append((s["workers"], s["median"]))
        for nodes, points in sorted(by_nodes.items()):
            points.sort()
            ax.plot(
                [p[0] for p in points], [p[1] for p in points], marker="o", label=f"{nodes} node(s)"
            )
        ax.set_xlabel("workers")
        ax.set_ylabel("cold start + first allreduce (s)")
        ax.set_title("B5 scaling")
        ax.legend()
        fig.tight_layout()
        fig.savefig(directory / "b5_scaling.png", dpi=100)
        plt.close(fig)
        written.append("b5_scaling.png")
    return written


def _sweep_point(text: str) -> tuple[int, int]:
    """``--sweep-point MB:RANKS`` as (bytes, ranks)."""
    megabytes, _, ranks = text.partition(":")
    if not (megabytes.isdigit() and ranks.isdigit() and int(megabytes) > 0 and int(ranks) > 1):
        raise argparse.ArgumentTypeError(f"{text!r}: give MB:RANKS, e.g. 64:2 (2 ranks or more)")
    return int(megabytes) << 20, int(ranks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(MODES), default="quick")
    parser.add_argument(
        "--only", default="b1,b2,b3,b4,b5,b6,b6e,b7,b8", help="comma-separated subset"
    )
    parser.add_argument("--out", default=str(RESULTS / "latest.json"))
    parser.add_argument(
        "--sweep-point",
        action="append",
        type=_sweep_point,
        metavar="MB:RANKS",
        help="with --only sweep: this point only (repeatable); default: all of SWEEP_POINTS",
    )
    args = parser.parse_args(argv)
    mode = MODES[args.mode]
    only = set(args.only.split(","))
    sweep_points = tuple(args.sweep_point or SWEEP_POINTS)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    results: dict = {
        "mode": args.mode,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    parts_s: dict[str, float] = {}

    def part(name: str, measure: Callable[..., dict], *args: object) -> None:
        if not set(name.split("+")) & only:
            return
        part_started = time.perf_counter()
        results.update(measure(*args))
        parts_s[name] = time.perf_counter() - part_started
        print(f"{name}: {parts_s[name]:.0f}s", flush=True)

    started = time.perf_counter()
    may_install = args.mode != "smoke"
    local_ray.start(num_cpus=NUM_CPUS, log_to_driver=False)
    with tempfile.TemporaryDirectory() as storage:
        part("b3", b3, mode)
        part("b1", b1, mode, may_install)
        part("b2", b2, mode)
        part("b4", b4, mode, storage)
        part("sweep", sweep, mode, may_install, sweep_points)
    local_ray.stop()
    part("b5", b5, mode)
    part("b6e", b6_elastic, mode)
    part("b7+b8", scripts, mode, "b7" in only, "b8" in only)
    # After the shutdown: the local Ray would otherwise idle beside the two hosts.
    part("b6", b6, mode, may_install)
    part("scale", scale.measure, mode.scale_reps, mode.scale_deadline_s, mode.scale_sizes)
    part("scale_start", scale.start_path, mode.scale_start_sizes, mode.scale_reps)
    results["parts_s"] = parts_s
    results["wall_s"] = time.perf_counter() - started
    results["plots"] = plot(results, out_path.parent)
    if "scale_by_way" in results:
        results["plots"].append(scale.plot(results, out_path.parent))
    out_path.write_text(json.dumps(results, indent=2))
    print_table(results)
    print(f"\nwrote {out_path} and {len(results['plots'])} plot(s) in {results['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
