"""B5: scaling, horovod_ray's cold start plus first allreduce over simulated nodes.

For each of the mode's (workers, nodes) points, a ``ray.cluster_utils.Cluster`` with that
many nodes, the workers spread evenly over them. Not in quick mode.
"""

from __future__ import annotations

import statistics
import time

from bench.cases import workloads
from bench.harness.common import Mode, cold_start_s, simulated_nodes, summary


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
                    values.append(cold_start_s(start, executor.run(workloads.first_allreduce)))
            out[f"{workers}x{nodes}"] = {"workers": workers, "nodes": nodes, **summary(values)}
            print(f"  {workers} workers on {nodes} nodes: {statistics.median(values):.2f}s")
    return {"b5_cold_start_s": out}
