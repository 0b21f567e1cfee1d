"""B3: call overhead, the median time of a no-op call on 4 workers.

horovod_ray's ``execute`` of a no-op and a repeated ``run(os.getpid)``, against a bare
fan-out of 4 Ray actor calls returning None: ``b3_ratio`` and ``b3_run_ratio``; and
horovod 0.28.1's own ``horovod.ray`` executing the same no-op: ``b3_horovod_ray_ratio``.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

from bench.cases import workloads
from bench.harness.common import Mode, alternate, ratio, summary


def b3(mode: Mode) -> dict:
    print("B3 call overhead, 4 workers, no-op", flush=True)
    # Imported here, not above: bench.harness.common sets Ray's environment before ray is imported.
    import ray
    from horovod.ray import RayExecutor as ReferenceExecutor

    from horovod_ray import RayExecutor

    # No CPU reserved: the two executors hold the 4 CPUs while all three run.
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
    # The three executors' 4 workers at a third of a CPU each, so that they fit the 4 CPUs
    # together.
    cpus = 0.33
    reference = ReferenceExecutor(
        ReferenceExecutor.create_settings(timeout_s=120), num_workers=4, cpus_per_worker=cpus
    )
    reference.start()
    settings = RayExecutor.create_settings(verbose=0)
    # The cost of the metrics, on by default (docs/observability.rst).
    quiet = RayExecutor(
        RayExecutor.create_settings(verbose=0, metrics=False), num_workers=4, cpus_per_worker=cpus
    )
    try:
        quiet.start()
        with RayExecutor(settings, num_workers=4, cpus_per_worker=cpus) as executor:
            executor.execute(workloads.noop)
            reference.execute(workloads.noop)
            quiet.execute(workloads.noop)
            systems = {
                "horovod_ray": lambda: timed(lambda: executor.execute(workloads.noop)),
                "horovod_ray metrics off": lambda: timed(lambda: quiet.execute(workloads.noop)),
                "horovod_ray run()": lambda: timed(lambda: executor.run(os.getpid)),
                "horovod.ray": lambda: timed(lambda: reference.execute(workloads.noop)),
                "bare_ray": lambda: timed(lambda: ray.get([a.noop.remote() for a in bare])),
            }
            runs = alternate(systems, mode.reps)
    finally:
        quiet.stop()
        reference.shutdown()
        for actor in bare:
            ray.kill(actor)
    return {
        "b3_call_ms": {name: summary(values) for name, values in runs.items()},
        "b3_ratio": ratio(runs["horovod_ray"], runs["bare_ray"]),
        "b3_run_ratio": ratio(runs["horovod_ray run()"], runs["bare_ray"]),
        "b3_ratio_metrics_on_vs_off": ratio(runs["horovod_ray"], runs["horovod_ray metrics off"]),
        "b3_horovod_ray_ratio": ratio(runs["horovod.ray"], runs["bare_ray"]),
    }
