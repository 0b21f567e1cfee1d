"""B2: cold start, from creating the job to the first allreduce result on every rank.

Framework import included, on each of the mode's worker counts: horovod_ray and
horovod.ray, with the import floor (fresh processes that only import TensorFlow and
horovod) in the same rotation; Ray Train's ``HorovodTrainer`` and ``horovodrun`` join it
at ``PEER_WORKERS`` only (at 4 workers they would add 2 minutes to the full pass). Each
run starts once the previous run's worker processes are gone (``alternate(..., settle=True)``).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Callable

from bench.cases import workloads
from bench.harness.common import (
    Mode,
    alternate,
    cold_start_s,
    horovod_ray_run,
    horovodrun,
    ratio,
    reference_run,
    summary,
)

# The worker counts at which B2 also runs HorovodTrainer and horovodrun.
PEER_WORKERS = (2,)

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


def horovod_trainer_first_allreduce(num_workers: int) -> float:
    """Ray Train's ``HorovodTrainer`` of B2's function; when rank 0's allreduce was done."""
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
        runs = alternate(_systems(workers), mode.reps, settle=True)
        floor = runs.pop("import floor")
        key = str(workers)
        out["b2_floor_s"][key] = summary(floor)
        out["b2_overhead_above_floor_s"][key] = {
            name: statistics.median(a - b for a, b in zip(values, floor, strict=True))
            for name, values in runs.items()
        }
        out["b2_cold_start_s"][key] = {name: summary(values) for name, values in runs.items()}
        out["b2_ratio_vs_horovod_ray"][key] = ratio(runs["horovod_ray"], runs["horovod.ray"])
        if "HorovodTrainer" in runs:
            out["b2_ratio_vs_horovod_trainer"][key] = ratio(
                runs["horovod_ray"], runs["HorovodTrainer"]
            )
    return out


def _systems(workers: int) -> dict[str, Callable[[], float]]:
    """Each system's cold start on ``workers`` ranks, and the import floor beside them;
    ``HorovodTrainer`` and ``horovodrun`` only at ``PEER_WORKERS``."""

    def measure(run: Callable[[], list[float]]) -> float:
        start = time.time()
        return cold_start_s(start, run())

    systems = {
        "horovod_ray": lambda: measure(lambda: horovod_ray_run(workers, workloads.first_allreduce)),
        "horovod.ray": lambda: measure(lambda: reference_run(workers, workloads.first_allreduce)),
        "HorovodTrainer": lambda: measure(lambda: [horovod_trainer_first_allreduce(workers)]),
        "horovodrun": lambda: measure(
            lambda: [json.loads(line)["first_allreduce_at"] for line in horovodrun(["b2"], workers)]
        ),
        "import floor": lambda: measure(lambda: import_floor(workers)),
    }
    if workers not in PEER_WORKERS:
        del systems["HorovodTrainer"], systems["horovodrun"]
    return systems
