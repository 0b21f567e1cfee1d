"""B1: allreduce throughput on 2 workers, and the sweep of Horovod's settings.

B1 times the same allreduce loop (``workloads.allreduce_throughput``) under horovod_ray,
``horovodrun``, horovod.ray and, when it can be built, raw Gloo's C++ ring, and reports
MB/s. The sweep (``--only sweep``, not in the default set) runs horovod_ray's allreduce
under each of SWEEP_SETTINGS at several sizes and rank counts.
"""

from __future__ import annotations

import functools
import json
from typing import Callable, Sequence

from bench.cases import workloads
from bench.harness.common import (
    Mode,
    alternate,
    horovod_ray_run,
    horovodrun,
    ratio,
    reference_run,
    summary,
)
from bench.peers.raw_gloo import ensure_gloo_binary, raw_gloo_seconds


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
        # The cost of the metrics, on by default: docs/observability.rst.
        "horovod_ray metrics off": lambda: mbps(
            horovod_ray_run(
                2, workloads.allreduce_throughput, nbytes, iters, warmup, metrics=False
            )[0]
        ),
        # As on a Ray the user started with ray.init(): Ray gives its workers niceness 15
        # (the bench's local Ray, like run()'s, gives 0).
        "horovod_ray nice 15": lambda: mbps(
            horovod_ray_run(2, workloads.allreduce_throughput, nbytes, iters, warmup, niceness=15)[
                0
            ]
        ),
        "horovodrun": lambda: mbps(
            json.loads(horovodrun(["b1", str(nbytes), str(iters), str(warmup)], 2)[0])["seconds"]
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
        "b1_ratio_metrics_on_vs_off": ratio(runs["horovod_ray"], runs["horovod_ray metrics off"]),
        "b1_ratio_at_rays_niceness_vs_horovodrun": ratio(
            runs["horovod_ray nice 15"], runs["horovodrun"]
        ),
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
